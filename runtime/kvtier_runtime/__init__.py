"""kvtier's in-pod runtime: tiered KV block store, eviction/admission policies, codecs, engine plug-ins.

This package must stay import-light: the operator imports ``kvtier_runtime.config`` (torch-free) and nothing
else, so nothing here may import torch at package import time.
"""
