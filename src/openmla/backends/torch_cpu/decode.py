"""torch backend: decode (being built; every entry raises a clear error until it lands)."""

def absorb(*args, **kwargs):
    raise ValueError("backend: the torch backend's absorb is not built yet; use backend=\"reference\"")


def unabsorb(*args, **kwargs):
    raise ValueError("backend: the torch backend's unabsorb is not built yet; use backend=\"reference\"")


def decode(*args, **kwargs):
    raise ValueError("backend: the torch backend's decode is not built yet; use backend=\"reference\"")


