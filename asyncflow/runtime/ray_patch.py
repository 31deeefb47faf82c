"""The one place asyncflow patches Ray's internals (``ray._private``), and only while a local Ray
of its own starts (:func:`lean_local_ray`).

What it patches, and why: ``ray.init`` of a local cluster starts a dashboard head
(``Node.start_api_server``) even with ``include_dashboard=False``, and an autoscaler monitor
(``RayParams.no_monitor`` False): two Python processes a one-run local cluster never uses, and
1.9 s of its start-up. Both are restored when the start returns or fails; a Ray version without
them starts as it always does; joining a cluster (``--address``) patches nothing.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def lean_local_ray(ray, full: bool = False):
    """While a local Ray of our own starts: no dashboard head (Ray starts one even with
    ``include_dashboard=False``, for its job and state APIs) and no autoscaler monitor -- two
    Python processes a one-run local cluster never uses. ``ray.init`` takes 1.8 s instead of
    3.7 s here (benchmarks/startup.py). ``full`` (``ASYNCFLOW_RAY_FULL=1``) starts them as Ray
    would. Both
    are Ray internals (``Node.start_api_server``, ``RayParams.no_monitor``); where a Ray version
    lacks them, Ray starts as it always does."""
    if full:
        yield
        return
    try:
        from ray._private import node as ray_node, parameter as ray_parameter

        node_cls, params_cls = ray_node.Node, ray_parameter.RayParams
        api, params_init = node_cls.start_api_server, params_cls.__init__
    except (ImportError, AttributeError):
        yield
        return

    def no_api_server(self, *args, **kwargs):
        return None

    def params(self, *args, **kwargs):
        kwargs.setdefault("no_monitor", True)
        params_init(self, *args, **kwargs)

    node_cls.start_api_server, params_cls.__init__ = no_api_server, params
    try:
        yield
    finally:
        node_cls.start_api_server, params_cls.__init__ = api, params_init
