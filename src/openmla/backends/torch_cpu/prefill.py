"""torch backend: prefill (being built; every entry raises a clear error until it lands)."""

def prefill(*args, **kwargs):
    raise ValueError("backend: the torch backend's prefill is not built yet; use backend=\"reference\"")


def flare_mla_prefill(*args, **kwargs):
    raise ValueError("backend: the torch backend's flare_mla_prefill is not built yet; use backend=\"reference\"")


