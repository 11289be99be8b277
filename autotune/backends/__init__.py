"""Engines the controller serves requests on: this project's own (autotune.control.controller) and, here,
engines reached over HTTP: llama.cpp's server, and OpenAI-compatible replicas (vLLM, SGLang)."""

from autotune.backends.base import Backend, BackendError, BackendRequest, BackendResponse
from autotune.backends.controller import BackendController, BackendResult
from autotune.backends.llamacpp import LlamaCppBackend, LlamaServer, LlamaServerSpec, family_servers
from autotune.backends.llamacpp_build import LLAMA_CPP_PYTHON, LlamaCpp, setup

__all__ = ["LLAMA_CPP_PYTHON", "Backend", "BackendController", "BackendError", "BackendRequest", "BackendResponse",
           "BackendResult", "LlamaCpp", "LlamaCppBackend", "LlamaServer", "LlamaServerSpec", "family_servers", "setup"]
