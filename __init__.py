"""specair: speculative decoding as ahead-of-time compiled static graphs."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so `import specair.models` does not load the runtime (and torch.compile machinery) with it.
    if name == "LLM":
        from specair.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specair.runtime.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
