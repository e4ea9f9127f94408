"""The drafts' own KV caches in the engine: keys and values per layer and a slot mask, in
buffers allocated once per batch and written in place.

A slot is one position of the draft's cache; a rejected token's slot stays as a hole (mask
False) when other rows of the batch kept theirs, as in decoding/kv.py. Appending t slots writes
[length, length + t) of preallocated buffers (capacity doubles when full, so a generation of n
tokens copies its cache O(log n) times instead of once per step as torch.cat would); cropping
moves `length` back. Attention reads views of the first `length` slots.
"""

from __future__ import annotations

import torch


class SlotKV:
    """layers x (keys, values) [B, kv_heads, capacity, head_dim] and a slot mask [B, capacity];
    the first `length` slots are the cache."""

    def __init__(self, batch: int, layers: int, kv_heads: int, head_dim: int, dtype, device,
                 capacity: int = 256):
        shape = (batch, kv_heads, capacity, head_dim)
        self._keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0

    @property
    def layers(self) -> int:
        return len(self._keys)

    @property
    def capacity(self) -> int:
        return self._mask.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """[B, length] bool: which slots hold a real token."""
        return self._mask[:, : self.length]

    def keys(self, layer: int = 0) -> torch.Tensor:
        """[B, kv_heads, length, head_dim]."""
        return self._keys[layer][:, :, : self.length]

    def values(self, layer: int = 0) -> torch.Tensor:
        return self._values[layer][:, :, : self.length]

    def buffers(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole buffers: keys, values [B, kv_heads, capacity, head_dim] and the slot mask
        [B, capacity], for code that writes slots in place (drafts/eagle3/compiled.py); slots
        at or past `length` hold stale values."""
        return self._keys[layer], self._values[layer], self._mask

    def reserve(self, t: int) -> None:
        """Room for t more slots without growing while they are written."""
        if self.length + t > self.capacity:
            self._grow(max(self.length + t, 2 * self.capacity))

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], valid: torch.Tensor) -> None:
        """One (k, v) [B, kv_heads, t, head_dim] per layer for t new slots, valid [B, t]."""
        start, end = self.length, self.length + valid.shape[1]
        self.reserve(end - start)
        for layer, (k, v) in enumerate(kv):
            self._keys[layer][:, :, start:end] = k
            self._values[layer][:, :, start:end] = v
        self._mask[:, start:end] = valid
        self.length = end

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """(k, v) [B, kv_heads, t, head_dim] of one layer into the last t slots (appended for
        another layer first: a layer's input is the output of the layer below)."""
        start = self.length - k.shape[2]
        self._keys[layer][:, :, start:self.length] = k
        self._values[layer][:, :, start:self.length] = v

    def crop(self, n: int) -> None:
        """Drop the last n slots."""
        self.length -= max(n, 0)

    def rows(self, index) -> SlotKV:
        """A cache of some rows (index: a slice or index tensor over the batch), sharing
        nothing with this one."""
        other = SlotKV.__new__(SlotKV)
        other._keys = [k[index].clone() for k in self._keys]
        other._values = [v[index].clone() for v in self._values]
        other._mask = self._mask[index].clone()
        other.length = self.length
        return other

    def _grow(self, capacity: int) -> None:
        def grown(buffer: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(buffer.shape)
            shape[dim] = capacity
            out = buffer.new_zeros(shape)
            out.narrow(dim, 0, self.length).copy_(buffer.narrow(dim, 0, self.length))
            return out

        self._keys = [grown(k, 2) for k in self._keys]
        self._values = [grown(v, 2) for v in self._values]
        self._mask = grown(self._mask, 1)
