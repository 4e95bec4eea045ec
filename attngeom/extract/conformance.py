"""The capture against the model's own eager attention, layer by layer (docs/models.md#conformance).

In one capturing forward, each attention call also runs the eager attention function of the
model's own modeling module on the same arguments, in float32, for a few queries: the rows
the capture computes and the layer's output are compared with the eager weights and output.
A family the tests do not cover is checked so before extract writes anything; ``attngeom
check-model`` runs the check alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from attngeom.errors import UnsupportedModelError
from attngeom.extract.call_terms import learned_sinks, per_query
from attngeom.extract.capture import capturing, decoder
from attngeom.extract.families import check_recorded, layer_kind

__all__ = ["ROW_TOLERANCE", "LayerCheck", "ModelCheck", "applied_rows", "check_capture", "check_model", "check_positions",
           "refuse_disagreement"]

# Largest |difference| allowed between a captured row and the eager weights, both float32
# (they differ by rounding, ~1e-7 on the tiny models of the tests).
ROW_TOLERANCE = 1e-4
# Largest |difference| allowed between outputs, relative to the largest |output| (at least 1).
OUTPUT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class LayerCheck:
    """One layer's comparison: the largest |difference| of its rows and of its output
    (relative to the largest |output|, at least 1), over the checked queries."""

    layer: int
    kind: str
    row_error: float
    output_error: float

    @property
    def agrees(self) -> bool:
        return self.row_error <= ROW_TOLERANCE and self.output_error <= OUTPUT_TOLERANCE


def check_positions(length: int, count: int = 6) -> tuple[int, ...]:
    """A few query positions spread over a window of ``length``, the last one included."""
    return tuple(sorted({round(i * (length - 1) / (count - 1)) for i in range(count)}))


def _eager_function(module: torch.nn.Module) -> Callable:
    """The eager attention of ``module``'s modeling module: what transformers runs for it
    with attn_implementation="eager" (each family's own, e.g. gpt-oss's with its sinks)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} has no eager attention to check the capture against"
        )
    return eager


def _eager_mask(mask: torch.Tensor | None, positions: torch.Tensor, length: int) -> torch.Tensor:
    """The additive float32 mask (B|1, 1|H, P, L) eager attention takes, for the queries at
    ``positions``, from the mask the capture was given (None: causal)."""
    low = torch.finfo(torch.float32).min
    if mask is None:
        keys = torch.arange(length, device=positions.device)
        return torch.where(keys[None, :] <= positions[:, None], 0.0, low)[None, None]
    rows = mask[:, :, positions, :length]
    if rows.dtype == torch.bool:
        return torch.where(rows, 0.0, low)
    return rows.float().clamp(min=low)


def applied_rows(weights: torch.Tensor, output: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The rows (B, H, P, L) a layer with learned sinks applies to its keys, from its eager
    attention's ``weights`` and ``output`` (B, P, H, Dv) on ``value`` (B, KV, L, Dv).

    gpt-oss's eager attention returns the weights after its sink (they sum to 1 - s_i);
    Granite-SWA's returns them before it and scales each head's output by 1 - s_i after the
    product. The scale each row took is read from the output, ``<o, w v> / <w v, w v>``
    (1 where the weights already carry the sink), so the reference is what the model applies
    whichever way its code applies the sink, without the capture's own s_i."""
    group = weights.shape[1] // value.shape[1]
    plain = weights @ value.repeat_interleave(group, dim=1)
    applied = output.transpose(1, 2)
    scale = (applied * plain).sum(-1) / (plain * plain).sum(-1)
    return weights * scale[..., None]


def check_capture(model: torch.nn.Module, ids: torch.Tensor, positions: tuple[int, ...]) -> list[LayerCheck]:
    """Capture one forward of ``model`` on ``ids`` (1, L) and compare, at query ``positions``,
    each attention layer's rows and output with its eager attention in float32. Refuses a
    model whose capture records other layers than its config declares."""
    errors: dict[int, tuple[float, float]] = {}
    where = torch.tensor(positions, device=ids.device)

    def compare(module, layer: int, query, key, value, *, mask, scaling: float, kwargs: Mapping, capture, output,
                reference: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        rows = capture.query_rows  # this forward keeps no other queries' rows
        try:
            # A family that computes attention in its own code brings that code's answer.
            out, weights = reference or _eager_function(module)(
                module, query[:, :, where].float(), key.float(), value.float(), _eager_mask(mask, where, key.shape[2]),
                scaling=scaling, dropout=0.0, **per_query(kwargs, where, query.shape[2]))
        except (RuntimeError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(
                f"the eager attention of {type(module).__name__} (layer {layer}) cannot run on the "
                f"arguments of its own attention call ({type(exc).__name__}): attngeom cannot check its capture"
            ) from exc
        ours = output[:, where].float()
        if learned_sinks(kwargs) is not None and weights is not None and weights.shape == rows.shape:
            weights = applied_rows(weights.float(), out.float(), value.float())
        # A shape that differs is a difference too: the eager attention computes something else.
        row_error = (float((rows - weights.float()).abs().max()) if weights is not None and weights.shape == rows.shape
                     else float("inf"))
        scale = max(1.0, float(out.abs().max()))
        output_error = float((ours - out.float()).abs().max()) / scale if out.shape == ours.shape else float("inf")
        errors[layer] = (row_error, output_error)

    training = model.training
    model.eval()
    try:
        with torch.inference_mode(), capturing(model, check_queries=positions, compare=compare) as recorder:
            decoder(model)(input_ids=ids, use_cache=False)
    finally:
        model.train(training)
    config = model.config.get_text_config()
    layers = check_recorded(config, list(recorder.layers))
    return [LayerCheck(layer, layer_kind(config, layer), *errors[layer]) for layer in layers]


def refuse_disagreement(checks: list[LayerCheck], model_type: str) -> None:
    """Refuse, naming the first layer and the size of its difference, when any layer's capture
    disagrees with its eager attention beyond the tolerances."""
    bad = [c for c in checks if not c.agrees]
    if bad:
        first = bad[0]
        raise UnsupportedModelError(
            f"the capture of model type '{model_type}' disagrees with its own eager attention in "
            f"{len(bad)} of {len(checks)} layers: layer {first.layer} ({first.kind}) rows differ "
            f"{_by(first.row_error)} and outputs {_by(first.output_error)} (tolerance {ROW_TOLERANCE:g}, "
            f"float32); attngeom refuses to store rows it cannot reproduce"
        )


def _by(error: float) -> str:
    return "in shape (the eager attention weighs other keys)" if error == float("inf") else f"by {error:.2g}"


@dataclass(frozen=True)
class ModelCheck:
    """``attngeom check-model``'s answer: the model type and each attention layer's check."""

    model_type: str
    layers: list[LayerCheck]

    def verdicts(self) -> list[str]:
        """One line per layer kind: its layers, the largest differences, agrees or not."""
        lines = []
        for kind in dict.fromkeys(c.kind for c in self.layers):
            checks = [c for c in self.layers if c.kind == kind]
            rows, outputs = max(c.row_error for c in checks), max(c.output_error for c in checks)
            bad = [c.layer for c in checks if not c.agrees]
            verdict = "agrees" if not bad else f"DISAGREES in layers {', '.join(map(str, bad))}"
            lines.append(f"{kind} (layers {', '.join(str(c.layer) for c in checks)}): rows within {rows:.1g}, "
                         f"outputs within {outputs:.1g} of eager attention: {verdict}")
        return lines

    @property
    def agrees(self) -> bool:
        return all(c.agrees for c in self.layers)


def check_model(name: str, *, device: str = "auto", dtype: str = "auto", length: int = 64,
                seed: int = 0) -> ModelCheck:
    """Load the model ``name`` (as extract takes it) and check its capture against its eager
    attention on BOS and ``length - 1`` seeded random tokens, at :func:`check_positions`."""
    from attngeom.extract.models import load_config, load_model, resolve_device, resolve_dtype, resolve_model
    from attngeom.extract.positions import check_context_length, config_positions

    source = resolve_model(name)
    config = load_config(source)
    check_context_length(length, config_positions(config), source.name, "--length")
    device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    model = load_model(source, device=device, dtype=torch_dtype)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, length), generator=generator)
    if config.bos_token_id is not None:
        ids[0, 0] = int(config.bos_token_id)
    return ModelCheck(config.model_type, check_capture(model, ids.to(device), check_positions(length)))
