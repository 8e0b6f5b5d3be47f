"""``perfx serve --ray``: perfx engine replicas behind one OpenAI endpoint on Ray Serve.

Ray Serve's HTTP proxy hands every request to an ingress deployment (``deployments.PerfxIngress``), which reads
the body, derives a prompt-prefix key from it (``prefix_key``) and forwards the request through a deployment
handle to one engine replica (``deployments.PerfxEngine``). The handle's request router
(``router.PrefixAffinityRouter``) sends equal keys to the same replica while it has a free KV-cache slot, else
to the least-loaded one. Each engine replica runs perfx's own ASGI app (``serving.app.create_app``) in-process
(``asgi_bridge``), so every route and behaviour of ``perfx serve`` is the same code there.

Only ``launch``, ``deployments`` and ``router`` import Ray; ``perfx serve`` without ``--ray`` imports none of
this package.
"""
