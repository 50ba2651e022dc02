"""OpenAI-compatible HTTP serving of trained checkpoints (`setdlm serve`, docs/serve.md).

cli.py (the command), loading.py (the model and its limits), schema.py (request bodies), intake.py
(bodies off the event loop: byte budget, pools), params.py (request -> SamplingConfig and choices),
scheduler.py (the decode loop thread), streaming.py (what a streamed step carries), responses.py
(OpenAI-shaped bodies), metrics.py (/metrics), auth.py (bearer token), app.py (the aiohttp routes).
"""
