"""The one exception type batchspec raises for bad input or an unusable setup.

Every message names the problem and, where there is one, the fix. The CLI prints it without a
traceback; library users can catch it (it is a ValueError).
"""


class BatchspecError(ValueError):
    """Bad input (prompt, parameter, model pair) or a setup that cannot work."""
