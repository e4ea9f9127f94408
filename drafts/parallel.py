"""What the parallel drafters (DFlash, PARD) share: the mask token, the blocks they are trained
on, and the attention inside a block.

A parallel drafter proposes k tokens in ONE forward. The step's last known token x_p (the token
the target just emitted) sits at position p; k mask tokens follow it (DFlash: positions
p+1..p+k, each predicting its own position's token; PARD: k-1 masks at p+1..p+k-1 after the
causal prediction at p). In chain_loss_rows' terms (drafts.kind) the block serves the
chain start s = p - 1: draft position j predicts x_{s+1+j} and is scored against the target's
distribution at s + j.

Training places such a block after many starts of each conversation at once. Which starts is a
deterministic function of the batch's loss mask (block_plan), so the loop's loss_rows() and the
module's forward agree without sharing state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafts.kind import LossRows
from recipe import ConfigError


def pick_mask_token(tokenizer, vocab_size: int, examples=()) -> int:
    """The token id that fills masked block positions: the tokenizer's mask token, else its
    highest added (special) token that is not BOS/EOS/PAD/UNK and never occurs in the data."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return check_mask_token(tokenizer.mask_token_id, vocab_size, "the tokenizer's mask token")
    reserved = {getattr(tokenizer, f"{name}_token_id", None)
                for name in ("bos", "eos", "pad", "unk")}
    reserved |= set(getattr(tokenizer, "all_special_ids", []) or [])
    seen: set[int] = set()
    for e in examples:
        seen.update(e.input_ids)
    added = sorted(i for i in tokenizer.get_added_vocab().values()
                   if i < vocab_size and i not in reserved and i not in seen)
    if not added:
        raise ConfigError("no unused special token to serve as the parallel drafter's mask: "
                          "set train.mask_token_id to a token id the data never contains.")
    return added[-1]


def resolve_mask_token(mask_id: int | None, tokenizer, vocab_size: int, examples=()) -> int:
    """train.mask_token_id checked against the vocabulary, or the default pick_mask_token."""
    if mask_id is not None:
        return check_mask_token(mask_id, vocab_size)
    return pick_mask_token(tokenizer, vocab_size, examples)


def check_mask_token(mask_id: int, vocab_size: int, where: str = "train.mask_token_id") -> int:
    if not 0 <= mask_id < vocab_size:
        raise ConfigError(f"{where}={mask_id} lies outside the vocabulary [0, {vocab_size}): the "
                          "mask token must be one of the target's token ids.")
    return mask_id


def loss_index(pred_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B, T] long: each loss position's row among the N loss positions
    (row-major, as boolean indexing orders them), -1 elsewhere."""
    index = torch.full(pred_mask.shape, -1, dtype=torch.long, device=pred_mask.device)
    index[pred_mask] = torch.arange(int(pred_mask.sum()), device=pred_mask.device)
    return index


@dataclass
class BlockPlan:
    """The blocks of one batch: S starts per row (padded), which are real, and which of each
    block's k draft positions have a loss position to be scored against."""

    starts: torch.Tensor
    """[B, S] long: start s of each block (its known token x_{s+1} sits at s+1)."""
    valid: torch.Tensor
    """[B, S] bool: a real block (x_{s+1} exists and s+1 is a loss position)."""
    scored: torch.Tensor
    """[k, B, S] bool: draft position j (index j-1) of the block is scored (s+j a loss
    position)."""

    def loss_rows(self, pred_mask: torch.Tensor, decay: float, first: int = 1) -> list[LossRows]:
        """One LossRows per draft position j = first..k: rows ordered by (b, block), weight
        decay**(j-1)."""
        index = loss_index(pred_mask)
        rows_of = torch.arange(pred_mask.shape[0], device=pred_mask.device)[:, None].expand_as(
            self.starts)
        runs = []
        for j in range(first, self.scored.shape[0] + 1):
            keep = self.scored[j - 1]  # [B, S]
            b, s = rows_of[keep], self.starts[keep]
            runs.append(LossRows(len(b), index[b, s + j], torch.stack([b, s], 1), j,
                              decay ** (j - 1)))
        return runs


def block_plan(pred_mask: torch.Tensor, k: int, per_row: int = 0) -> BlockPlan:
    """The starts a batch trains: every start whose first draft position is a loss position
    (per_row = 0), or per_row of them per conversation drawn at random, seeded by the batch
    itself (the same batch always gives the same plan). pred_mask [B, T] -> BlockPlan with S =
    the most starts of any row (rows with fewer are padded with invalid blocks)."""
    batch, length = pred_mask.shape
    device = pred_mask.device
    candidate = torch.zeros_like(pred_mask)
    candidate[:, :-1] = pred_mask[:, 1:]  # start s serves x_{s+1}...: s+1 must be a loss position
    if per_row <= 0:  # every candidate, in position order, rows padded to the longest
        count = int(candidate.sum(1).max()) if batch else 0
        picked = torch.sort((~candidate).to(torch.uint8), dim=1, stable=True).indices[:, :count]
    else:
        seed = int(pred_mask.sum()) * 1_000_003 + length * 7_919 + batch
        noise = torch.rand(batch, length, generator=torch.Generator().manual_seed(seed))
        noise = noise.to(device).masked_fill(~candidate, -1.0)
        picked = noise.topk(min(per_row, length), dim=1).indices.sort(dim=1).values  # [B, S]
    starts, valid = picked, candidate.gather(1, picked)
    t = starts[None] + torch.arange(1, k + 1, device=device)[:, None, None]  # [k, B, S]
    loss_at_t = torch.stack([pred_mask.gather(1, t_j.clamp(max=length - 1)) for t_j in t])
    scored = valid[None] & (t < length) & loss_at_t  # [k, B, S]
    return BlockPlan(starts, valid, scored)


def block_attention(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor,
                    k_context: torch.Tensor, v_context: torch.Tensor,
                    context_allowed: torch.Tensor) -> torch.Tensor:
    """Attention of S blocks per row: each query sees the context keys its block may see and
    every key of its own block (non-causal inside the block, DFlash's attention).

    q [B, n, S, m, d]; k_block, v_block [B, kv, S, m, d]; k_context, v_context [B, kv, L, d],
    with n = kv * g (grouped-query: query head h reads kv head h // g, read in place, never
    repeated); context_allowed [B, S, L] bool -> [B, n, S, m, d]."""
    batch, heads, blocks, m, d = q.shape
    kv = k_context.shape[1]
    scale = d ** -0.5
    q = q.view(batch, kv, heads // kv, blocks, m, d)
    to_context = torch.einsum("bkgsqd,bkld->bkgsql", q, k_context) * scale  # [B,kv,g,S,m,L]
    to_context = to_context.masked_fill(~context_allowed[:, None, None, :, None, :],
                                        float("-inf"))
    to_block = torch.einsum("bkgsqd,bkspd->bkgsqp", q, k_block) * scale  # [B,kv,g,S,m,m]
    probs = torch.softmax(torch.cat([to_context, to_block], -1).float(), -1).to(q.dtype)
    length = k_context.shape[2]
    out = (torch.einsum("bkgsql,bkld->bkgsqd", probs[..., :length], v_context)
           + torch.einsum("bkgsqp,bkspd->bkgsqd", probs[..., length:], v_block))
    return out.reshape(batch, heads, blocks, m, d)


def pard_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, plan: BlockPlan, k: int,
                mask_id: int):
    """A right-padded batch with k-1 mask tokens appended per block start, for one causal-LM
    forward that trains PARD's parallel positions.

    Block i of row b (start s) appends masks at positions s+2..s+k; mask m sees the row's real
    tokens up to s+1 and the masks before it in its block. input_ids, attention_mask [B, T] ->
    (ids [B, T+S(k-1)], position_ids [B, T+S(k-1)], mask [B, 1, T+S(k-1), T+S(k-1)] bool)."""
    batch, length = input_ids.shape
    device = input_ids.device
    starts, masks = plan.starts.shape[1], k - 1  # S blocks per row
    width = length + starts * masks
    ids = torch.full((batch, width), mask_id, dtype=input_ids.dtype, device=device)
    ids[:, :length] = input_ids
    positions = torch.zeros(batch, width, dtype=torch.long, device=device)
    positions[:, :length] = torch.arange(length, device=device)
    offsets = torch.arange(1, masks + 1, device=device)  # [k-1]: mask m sits at s + 1 + m
    positions[:, length:] = (plan.starts[:, :, None] + 1 + offsets).reshape(batch, -1)

    real = attention_mask.bool()
    allowed = torch.zeros(batch, width, width, dtype=torch.bool, device=device)
    allowed[:, :length, :length] = torch.ones(length, length, dtype=torch.bool,
                                              device=device).tril() & real[:, None, :]
    up_to = torch.arange(length, device=device)[None, None] <= (plan.starts + 1)[:, :, None]
    context = (up_to & real[:, None, :] & plan.valid[:, :, None])  # [B, S, T]
    allowed[:, length:, :length] = context.repeat_interleave(masks, dim=1)
    own = torch.ones(masks, masks, dtype=torch.bool, device=device).tril()  # [k-1, k-1]
    blocks = torch.block_diag(*[own] * starts) if starts else own[:0, :0]
    allowed[:, length:, length:] = blocks
    return ids, positions, allowed[:, None]
