"""Test helper: record what a `DeltaForCausalLM`'s decoder is called with."""


def record_decoder_calls(model) -> list[int]:
    """Wrap `model.model.forward`; the returned list gets the token count of every later call, in order."""
    seen, decoder_forward = [], model.model.forward

    def recording_forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        return decoder_forward(*args, **kwargs)

    model.model.forward = recording_forward
    return seen
