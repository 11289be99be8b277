"""`autotune serve`: the OpenAI-compatible HTTP server over the controller.

`server` builds the FastAPI app and runs it on uvicorn with its transport limits;
`openai_api` holds the request and response models; `prometheus` the `/metrics` exposition.
"""
