"""The speculation policy: how many drafts a step asks for and verifies (`-k auto` from measured
costs, `costmodel`; or a fixed k). Above the proposers, whose confidence bins it learns from."""
