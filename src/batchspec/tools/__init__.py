"""What the `bench` and `verify` commands compute: runs compared side by side, the speed-of-light
model, exactness against the reference, prompt files."""
