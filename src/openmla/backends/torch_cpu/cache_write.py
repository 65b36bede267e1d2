"""torch backend: cache_write (being built; every entry raises a clear error until it lands)."""

def write_cache(*args, **kwargs):
    raise ValueError("backend: the torch backend's write_cache is not built yet; use backend=\"reference\"")


