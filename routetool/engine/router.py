"""The one routing call: :class:`Router`, a router spec routed by a function, every call judged by
the one contract (:mod:`routetool.engine.contract`).

replay, validate, balance and bench route through it, the kernel under test and the PyTorch
reference alike. The shape follows vLLM's ``BaseRouter`` (one template method: check the
call, compute it, map the outputs), with the judging of :func:`~routetool.engine.contract.call_kernel`
as its check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from routetool.engine.contract import InputGuard, KernelOutcome, RoutingFn, call_kernel, modified_outcome
from routetool.engine.stream import Chunk, ChunkRouting
from routetool_kernels.spec import SEED_NORMALIZATIONS, RouterSpec

REFERENCE_NAME = "reference (PyTorch)"
"""How reports name the PyTorch reference as a router."""


def _reference(gating_output, bias, topk_weights=None, topk_ids=None, **kwargs):
    """The PyTorch reference with the launchers' keywords (it writes no caller buffers)."""
    from routetool_kernels.reference import musespark1x_routing_reference

    return musespark1x_routing_reference(gating_output, bias, **kwargs)


@dataclass(frozen=True)
class Router:
    """A router spec routed by a function with the seed's signature.

    Attributes:
        spec: the router's parameters; its :meth:`~routetool_kernels.spec.RouterSpec.kernel_kwargs`
            are the call's keywords.
        fn: the kernel under test (``fn(gating_output, bias, topk, route_scale, ...)``), or the
            reference (:meth:`reference`).
        name: for reports and errors (``tiled``, ``reference (PyTorch)``).
        per_row: ``fn`` routes each row independently of the others in its batch (the reference),
            so :meth:`route` calls it once per chunk; a kernel runs once per captured step, on that
            step's own rows, as the engine called it.
        on_routed: the capture hook, or None: called with each chunk and its routing after every
            successful :meth:`route` (as vLLM's ``BaseRouter`` hands its routed experts to a
            capturer), e.g. to keep a kernel's outputs (``routetool replay --save-routing``).
    """

    spec: RouterSpec
    fn: RoutingFn
    name: str = "kernel"
    per_row: bool = False
    on_routed: Callable[[Chunk, ChunkRouting], None] | None = field(default=None, compare=False)

    @cached_property
    def _keywords(self) -> tuple[dict[str, object], str | None]:
        """The spec's keywords for ``fn`` (made once: a kernel is called once per captured step),
        and the first semantics beyond the seed's (``n_group``, ``sqrtsoftplus``, ``norm_topk_prob``:
        :meth:`~routetool_kernels.spec.RouterSpec.beyond_seed`), which a kernel that rejects the
        call must name in its docstring, or None."""
        beyond = self.spec.beyond_seed()
        return self.spec.kernel_kwargs(), beyond[0] if beyond else None

    @classmethod
    def reference(cls, spec: RouterSpec) -> Router:
        """The PyTorch reference (:mod:`routetool_kernels.reference`) as a router of ``spec``."""
        return cls(spec, _reference, REFERENCE_NAME, per_row=True)

    def call(self, gating_output: torch.Tensor, bias: torch.Tensor, *, is_padding: torch.Tensor | None = None,
             topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
             feature: str | None = None, check_inputs: bool = True,
             extra: Mapping[str, object] | None = None) -> KernelOutcome:
        """One call on ``[n, E]`` logits, judged by the contract.

        Args:
            gating_output: ``[n, E]`` float32/bfloat16/float16 logits. bias: ``[E]``.
            is_padding: ``[n]`` bool or None. topk_weights / topk_ids: caller buffers or None.
            feature: the input's unusual feature (see :func:`~routetool.engine.contract.call_kernel`);
                by default the logits' dtype, or the first semantics the spec sets beyond the seed's
                (``n_group``, ``sqrtsoftplus``...).
            check_inputs: compare the inputs after the call (False inside a CUDA-graph capture).
            extra: more keywords for ``fn`` (``use_pdl``).

        Returns:
            A :class:`~routetool.engine.contract.KernelOutcome` (never raises for what ``fn`` does).
        """
        params, beyond = self._keywords
        if feature is None:
            feature = beyond
        if extra:
            params = {**params, **extra}
        return call_kernel(self.fn, gating_output, bias, params=params, is_padding=is_padding,
                           topk_weights=topk_weights, topk_ids=topk_ids, feature=feature, check_inputs=check_inputs)

    def route(self, chunk: Chunk, bias: torch.Tensor, *, gating_output: torch.Tensor | None = None,
              feature: str | None = None) -> ChunkRouting:
        """The chunk's rows routed: a kernel once per captured step (the chunk must hold whole
        steps), a per-row router once for the chunk; the inputs are guarded once for the chunk
        (a call that changed them fails as ``modified_input``). A successful routing is handed to
        the capture hook (:attr:`on_routed`).

        Args:
            chunk: from :func:`~routetool.engine.stream.stream_layer`. bias: ``[E]`` float32 on its device.
            gating_output: ``[rows, E]`` to route instead of the chunk's logits. feature: as :meth:`call`.

        Returns:
            A :class:`~routetool.engine.stream.ChunkRouting`: the outputs, or the first failed call.
        """
        gating = chunk.gating_output if gating_output is None else gating_output
        pad = chunk.is_padding
        if not (self.per_row or chunk.whole):
            raise ValueError("a kernel routes whole steps: stream the layer with whole_steps=True")
        guard = InputGuard(gating_output=gating, bias=bias, is_padding=pad)
        calls = [(0, gating.shape[0])] if self.per_row else list(zip(chunk.offsets, chunk.offsets[1:]))
        weights, ids = [], []
        for s, (a, b) in enumerate(calls):
            out = self.call(gating[a:b], bias, is_padding=None if pad is None else pad[a:b], feature=feature,
                            check_inputs=False)
            if not out.ok:
                return ChunkRouting(None, None, out, chunk.first_step + s, s + 1)
            weights.append(out.weights)
            ids.append(out.ids)
        changed = guard.changed()
        if changed:
            rows = [guard.first_changed_row(n) for n in changed if n != "bias"]
            step = chunk.step_of(min(rows)) if rows else chunk.first_step
            return ChunkRouting(None, None, modified_outcome(changed), step, len(calls))
        if len({t.dtype for t in ids}) > 1:  # int32 from some calls, int64 from others
            ids = [t.long() for t in ids]
        routed = ChunkRouting(torch.cat(weights), torch.cat(ids), calls=len(calls))
        if self.on_routed is not None:
            self.on_routed(chunk, routed)
        return routed

    def error(self, outcome: KernelOutcome, where: str, *, path: object, layer: int, name: str | None = None):
        """The error that stops a command on ``outcome`` (a failed call of this router at ``where``,
        e.g. ``layer 0 step 3``), named ``name`` (default :attr:`name`): a kernel that rejected a
        spec asking for semantics beyond the seed's (:meth:`RouterSpec.beyond_seed`: groups, another
        scoring, raw weights) is named with the router options it does not implement, on the
        trace's metadata, with the fix (a kernel that implements them, such as the reference);
        anything else as :meth:`KernelOutcome.error`, on the layer's logits.

        Returns:
            :class:`~routetool.errors.KernelRejection` (exit 2) for a documented rejection,
            :class:`~routetool.errors.KernelError` (exit 1) otherwise.
        """
        from routetool.errors import KernelError, KernelRejection

        name = name or self.name
        rejected = outcome.failure_class in ("rejected_documented", "rejected_undocumented")
        if not (rejected and self.spec.beyond_seed()):
            return outcome.error(name, where, path=path, tensor=f"layers.{layer}.gating_output")
        params = self.spec.kernel_kwargs()
        asked = [f"{k}={params[k]}" for k in RouterSpec.BEYOND_SEED if k in params]
        if self.spec.router_score_normalization not in SEED_NORMALIZATIONS:
            asked.insert(0, f"router_score_normalization={self.spec.router_score_normalization!r}")
        message = (f"{name} does not implement the router's {', '.join(asked)} (docs/semantics.md): it rejected "
                   f"{where} ({outcome.detail})")
        fix = ("route with a --kernel that implements them, e.g. the reference: "
               "--kernel routetool_kernels.reference:musespark1x_routing_reference")
        if outcome.failure_class == "rejected_documented":
            return KernelRejection(message, path=path, tensor="__metadata__", fix=fix)
        return KernelError(message + ", a rejection its docstring does not document", failure_class=outcome.failure_class,
                           path=path, tensor="__metadata__", fix=outcome.fix or fix)

    def route_or_raise(self, chunk: Chunk, bias: torch.Tensor, path: str, *, context: str = "",
                       whole_chunk: bool = False) -> ChunkRouting:
        """:meth:`route`, or the broken contract as an error named by layer and step.

        ``whole_chunk``: one call on all of the chunk's rows, whatever the router (an analysis of
        the logits, such as the bias effect's routing with the bias zeroed, not the captured calls).

        Raises:
            RouteToolError: ``fn`` broke the contract (:meth:`KernelOutcome.error`: exit 2 for a
                documented rejection, 1 for anything else).
        """
        if whole_chunk:
            out = self.call(chunk.gating_output, bias, is_padding=chunk.is_padding)
            routed = ChunkRouting(out.weights, out.ids, None if out.ok else out, chunk.first_step, 1)
            step = f"{chunk.first_step}-{chunk.first_step + chunk.num_steps - 1}" if chunk.num_steps > 1 \
                else chunk.first_step
        else:
            routed = self.route(chunk, bias)
            step = routed.step
        if not routed.ok:
            where = f"layer {chunk.layer}, step{'s' if isinstance(step, str) else ''} {step}" \
                    f"{' ' + context if context else ''}"
            raise self.error(routed.outcome, where, path=path, layer=chunk.layer)
        return routed

