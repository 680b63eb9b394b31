"""Running an unmodified model's forward on this rank's part of each sequence.

Note [sequence parallelism]
With sequence_parallel.size S, the S ranks of a group train on the same samples, each on a part of
every sequence (world = dp × S; every rank holds the same weights, so gradients are averaged and ZeRO
shards over all of them; with 1D tensor parallelism world = dp × S × t, and that holds for the ranks of
one tp rank, each running its own heads: Note [one mesh]). engine(...) splits the forward's
sequence-shaped arguments along dim 1:
- every tensor argument of the sequence's length along dim 1 (input_ids, labels, token_type_ids,
  ...); the parts are contiguous for Ulysses, zigzag for ring (Note [ring attention]);
- `labels` are shifted before they are split (the next token of a part's last position lives on
  another rank): Hugging Face models get `shift_labels` (their loss then does not shift again);
  models that take already-shifted labels (the example GPT) get theirs as they are;
- `position_ids` are the tokens' global positions (given ones are split like the rest); a model
  whose forward takes no position_ids is refused (its positions would be the part's, silently).
Inside the forward, a Hugging Face model's attention runs through an implementation registered for the
split in transformers' attention interface, with each layer's window and softcapping (Note [Hugging Face
attention under sequence parallelism]); in another model a TorchFunctionMode routes every
F.scaled_dot_product_attention call (causal, without a mask) to ring or Ulysses attention over the group.
A mask tensor or attention dropout is refused, naming what to do, and so is a forward that ran no attention
either way (its attention, written out by hand, would see this rank's part only). "auto" picks Ulysses when the model's
heads (per tp rank) divide by S, else ring, and says which. The model's loss is its mean over this
rank's tokens; engine.backward weighs it by this rank's share of the group's counted tokens (labels
other than -100) times S, so that averaging the gradients over the ranks gives the loss over every token
of the sample, whatever S and the padding. The loss the forward returns (a scalar output, or the `loss`
of a mapping or Hugging Face output) has the value of the whole sequence's loss, the token-weighted mean
over the group's counted tokens, and the gradient of this rank's own loss: a printed loss means what it
means without sequence parallelism, and backward is unchanged. Under a pipeline every stage's forward
takes this rank's part of the micro-batch the same way, so the hidden state sent between stages is this
rank's part, and the last stage's loss carries the token weight in its gradient itself
(`scheduled_loss`), as the schedule runs the backward (Note [a pipelined step]).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.comm import CommCounter
from engine.hf_model import transformers_model
from engine.outputs import replace_loss
from engine.sequence_parallel.attending import Attending
from engine.sequence_parallel.hf_attention import InterfaceAttention, refuse_alibi
from engine.sequence_parallel.ring_attention import ring_attention, zigzag_positions
from engine.sequence_parallel.ulysses import ulysses_attention

IGNORE_INDEX = -100


def choose_mode(mode: str, model, size: int, tp_size: int = 1) -> str:
    """"auto": Ulysses when the model's attention heads on one tensor-parallel rank divide by `size`, else ring."""
    if mode != "auto":
        return mode
    config = getattr(model, "config", None)
    heads = next((getattr(config, k) for k in ("num_attention_heads", "n_head") if hasattr(config, k)), None)
    return "ulysses" if heads is not None and heads % tp_size == 0 and heads // tp_size % size == 0 else "ring"


class SequenceSplit:
    """Splits a forward's arguments over the ranks of `group` and runs the forward's attention over them."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int, mode: str, model: nn.Module,
                 counter: CommCounter | None = None):
        """counter: where the attention's all-to-all and point-to-point bytes are counted (the engine's)."""
        self.group, self.size, self.rank, self.mode = group, size, rank, mode
        self.counter = counter
        hf_model = transformers_model(model)  # the model itself, or the one a PEFT model wraps
        # labels the model shifts itself (Hugging Face): passed as shift_labels
        self.hf_labels = hf_model is not None
        # positional arguments by name, so that labels passed positionally are found
        parameters = inspect.signature(model.forward).parameters.values()
        self.positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        self.takes_positions = any(p.name == "position_ids" or p.kind is inspect.Parameter.VAR_KEYWORD
                                   for p in parameters)
        if not self.takes_positions:
            raise ValueError(f"sequence parallelism gives each rank its tokens' global positions as position_ids, "
                             f"and {type(model).__name__}.forward takes no position_ids; add a position_ids argument "
                             "that the model's position embedding (or rotary) uses")
        self.token_weight = 1.0  # of the last forward's loss (Note [sequence parallelism])
        self.attended = 0  # attention calls run over the group so far
        self.attending = False
        self.model_name = type(model).__name__
        if hf_model is not None:
            refuse_alibi(hf_model)
        self.interface = InterfaceAttention(self, hf_model) if hf_model is not None else None
        # transformers' own checkpointing would recompute attention in backward, outside the split (refused)
        self.own_checkpointing = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]

    def positions(self, seq_len: int, device) -> torch.Tensor:
        if self.mode == "ring":
            return zigzag_positions(seq_len, self.rank, self.size, device)
        if seq_len % self.size:
            raise ValueError(f"sequence_parallel.size {self.size} splits each sequence into equal parts, and a "
                             f"sequence of {seq_len} tokens does not divide by {self.size}; pad it to a multiple")
        part = seq_len // self.size
        return torch.arange(self.rank * part, (self.rank + 1) * part, device=device)

    def split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """This rank's part of every sequence-shaped argument, labels shifted first, global positions added."""
        seq_len = _sequence_length(args, kwargs)
        named = dict(zip(self.positional, args))
        if len(named) == len(args) and not named.keys() & kwargs.keys():  # every positional one has a name
            args, kwargs = (), {**named, **kwargs}
        kwargs = dict(kwargs)
        if "attention_mask" in kwargs and kwargs["attention_mask"] is not None:
            raise ValueError("sequence parallelism splits the sequence, and an attention_mask cannot be split with it "
                             "(padding or packed documents); give full-length sequences without a mask")
        labels = kwargs.get("labels")
        if labels is not None and self.hf_labels:  # shifted on the whole sequence, before it is split
            kwargs["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        positions = self.positions(seq_len, _device(args, kwargs))
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = positions.unsqueeze(0)
        else:
            _refuse_restarts(kwargs["position_ids"])
        local = lambda t: t[:, positions] if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == seq_len else t  # noqa: E731
        args = tuple(local(a) for a in args)
        kwargs = {k: local(v) for k, v in kwargs.items()}  # every sequence-shaped argument
        counted = kwargs.get("shift_labels", kwargs.get("labels"))
        self.token_weight = self._token_weight(counted)
        return args, kwargs

    def _token_weight(self, local_labels: torch.Tensor | None) -> float:
        """S × this rank's share of the group's counted tokens (1.0 without labels: equal shares)."""
        if local_labels is None:
            return 1.0
        counts = torch.tensor([float((local_labels != IGNORE_INDEX).sum())], dtype=torch.float64,
                              device=local_labels.device)  # where the group's backend reduces (nccl: the GPU)
        total = counts.clone()
        dist.all_reduce(total, group=self.group)
        return float(counts / total) * self.size if total.item() > 0 else 1.0

    def whole_loss(self, output):
        """`output` with its loss valued as the whole sequence's (Note [sequence parallelism]); an output
        without a loss (engine.outputs) is returned as it is."""
        return replace_loss(output, self._whole)

    def scheduled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a pipeline's last stage backpropagates (Note [a pipelined step]): the whole sequence's value,
        and the gradient of this rank's loss times its token weight, which engine.backward applies otherwise."""
        whole = self._whole(loss)
        weighted = whole * self.token_weight
        return weighted + (whole - weighted).detach()

    def _whole(self, loss: torch.Tensor) -> torch.Tensor:
        weighted = loss.detach().float() * (self.token_weight / self.size) if self.token_weight else \
            torch.zeros((), device=loss.device)  # a part with no counted tokens (its mean is nan) adds nothing
        dist.all_reduce(weighted, group=self.group)
        own = loss if self.token_weight else loss.nan_to_num(0.0)
        return own + (weighted.to(loss.dtype) - own.detach())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, window: int | None = None,
               softcap: float | None = None, where: str = "the attention") -> torch.Tensor:
        """Causal attention over the group for this rank's part of the sequence ([B, H, T/S, D] each); window: a key
        this many positions or more before its query is hidden; softcap: logits capped at ±softcap."""
        if self.mode == "ring" and softcap is not None:
            raise ValueError(f"sequence parallelism: {where} caps its attention logits (softcapping), which ring "
                             "attention does not; use sequence_parallel.mode \"ulysses\"")
        self.attended += 1
        self.attending = True  # its own scaled_dot_product_attention calls pass the mode
        how = Attending(scale, window, softcap)
        try:
            if self.mode == "ring":
                return ring_attention(q, k, v, self.positions(q.shape[2] * self.size, q.device), self.group, how,
                                      self.counter)
            return ulysses_attention(q, k, v, self.group, how, self.counter)
        finally:
            self.attending = False

    @contextlib.contextmanager
    def attention(self):
        """The context a forward (or a checkpoint's recompute) runs in: its attention over the group."""
        with self.interface.active() if self.interface is not None else contextlib.nullcontext(), \
                _SplitAttention(self):
            yield

    @contextlib.contextmanager
    def forward_context(self):
        """`attention()` around the model's forward, which must run some attention over the group."""
        checkpointed = next((m for m in self.own_checkpointing if m.gradient_checkpointing is True), None)
        if checkpointed is not None and torch.is_grad_enabled():
            raise ValueError(f"sequence parallelism: {type(checkpointed).__name__} runs transformers' own gradient "
                             "checkpointing, whose recompute in backward would run attention outside the split; turn "
                             "it off (model.gradient_checkpointing_disable()) and set activation_checkpointing "
                             "{\"enabled\": true} in the config, which recomputes over the split sequence")
        before = self.attended
        try:
            with self.attention():
                yield
        except (TypeError, AttributeError, KeyError, NotImplementedError) as error:
            if self.attended != before:  # a model that branches on its attention implementation's name and fails
                raise
            raise self._no_attention(f", and it raised {type(error).__name__}: {error}") from error
        if self.attended == before:
            raise self._no_attention("")

    def _no_attention(self, more: str) -> ValueError:
        return ValueError(f"sequence parallelism: {self.model_name}'s forward ran no attention Tiers splits (no "
                          "torch.nn.functional.scaled_dot_product_attention call, nor a Hugging Face attention "
                          f"implementation){more}: attention written out by hand, such as ALiBi attention, would see "
                          "this rank's part of the sequence only; use sequence_parallel.size 1, or a transformers "
                          "release whose model calls its attention through AttentionInterface")

    def close(self) -> None:
        if self.interface is not None:
            self.interface.uninstall()


class _SplitAttention(TorchFunctionMode):
    def __init__(self, split: SequenceSplit):
        super().__init__()
        self.split = split

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.split.attending:
            return func(*args, **kwargs)
        if self.split.interface is not None:
            raise ValueError(f"sequence parallelism: {self.split.model_name} calls scaled_dot_product_attention "
                             "outside its attention implementation, where Tiers cannot split it; use "
                             "sequence_parallel.size 1")
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        if mask is not None or not causal:
            raise ValueError("sequence parallelism runs causal attention without a mask tensor over the split "
                             "sequence; this model's attention passes a mask (or is not causal): load it with "
                             "attn_implementation=\"sdpa\" and no attention_mask, or use sequence_parallel.size 1")
        if dropout:
            raise ValueError("attention dropout is not supported under sequence parallelism; set the model's "
                             "attention dropout to 0")
        return self.split.attend(q, k, v, kwargs.get("scale"))


def _refuse_restarts(position_ids: torch.Tensor) -> None:
    """Given positions must run on by one along each row: ones that restart mark packed documents, whose mask the
    split attention does not build (Note [Hugging Face attention under sequence parallelism])."""
    if position_ids.shape[-1] > 1 and bool((position_ids.diff(dim=-1) != 1).any()):
        raise ValueError("sequence parallelism: the position_ids given restart or skip within a sequence (packed "
                         "documents), and the split attention runs one causal sequence per row; give one document "
                         "per row, or leave position_ids out")


def _sequence_length(args: tuple, kwargs: dict) -> int:
    for value in list(args) + [kwargs.get(k) for k in ("input_ids", "inputs_embeds")]:
        if torch.is_tensor(value) and value.dim() >= 2:
            return value.shape[1]
    raise ValueError("sequence parallelism needs the token sequence ([batch, sequence]) as the forward's first "
                     "argument or as input_ids / inputs_embeds")


def _device(args: tuple, kwargs: dict):
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value):
            return value.device
    return None
