"""One line naming an exception, for the peer scripts' skipped rows and notes (gpu_peers.py, sdpa_device.py).

An exception with an empty message (a bare `RuntimeError()`) gives its type alone: `str(e).splitlines()[0]` would
raise IndexError inside the handler and lose every later row.
"""


def error_line(e, limit=200):
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines else type(e).__name__
