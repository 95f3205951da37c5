"""A step's forward shared out between the devices of a lane (`--cfg-parallel 2`,
`--sequence-parallel N`, or both: 2 x N devices).

Every device holds the same states (the same plans reach all; seeds, schedulers and latents
are the same), so each computes only what it owns of a step's forward:

- CFG-parallel: every guided request's negative rows run on one CFG share and its positive
  rows on the other; a request without guidance runs whole on whichever has fewer rows so
  far (share 0 on a tie), or on share 0 where it caches (its First-Block Cache residuals
  live where its rows were computed, and the lead counts every request's skips). After one
  `all_gather` between the two shares every device has every row's prediction.
- Sequence parallel: the devices of one CFG share run the same rows, and the denoiser's
  context-parallel hooks (diffusers', `pipelines.parallel.sequence`) split each forward's
  tokens between them and gather the output: each gets the whole prediction of its rows.

Then the guidance, the scheduler steps and the states' commit run on each device alike, so
the latents stay identical without being sent (see docs/architecture.md, "A lane of several
devices"). TaylorSeer's series are of the guided predictions, so they are the same on every
device too.

First-Block Cache decides inside the forward, after its first block: each member's forward
is told which rows of the step's batch it runs and how to sum a request's figures with the
members that hold its other rows or tokens (`pipelines.cache.calls`), so every member takes
each request's decision over all of that request's rows and tokens, as one device would.
The sum is one `all_reduce` per forward: over the whole lane when both CFG shares run rows
(each then makes one forward per step: FLUX's, the family that splits guided rows and
caches), else over the devices of the share that runs them (its token shards).

Around the forward, the devices exchange whether their share ran and which step they took
(a checksum of the blocks): a share that raised makes every device raise, so the stage
runner's retry in halves runs the same halves on each; devices whose steps differ, or a
collective that fails (a member gone, the group's timeout), mean the lane is broken, and
this process ends so that the whole group is restarted (`engine.executor.lane_group`).
A forward that exchanges inside the denoiser (split tokens, a First-Block Cache sum over
devices) and raises ends this process too: the others may be waiting in one of its
exchanges, which nothing but this process's end releases before the group's timeout (the
supervisor then kills them at once), and no exchange can ask them where they are.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import Any, NoReturn

import torch

from pipelines.cache.calls import Summed, denoiser_call
from pipelines.parallel.seat import LaneSeat
from pipelines.stepping.state import RowBlock, RunBlocks

logger = logging.getLogger(__name__)

# The exit status of a member that left a broken lane (its supervisor restarts the group).
BROKEN_LANE_EXIT = 70


class PeerStepError(RuntimeError):
    """Another device of the lane failed its share of this step."""


class LaneSplit:
    """The member at `seat`; `cfg_group` joins the two CFG shares' members of its sequence
    rank (None: the whole lane, or no CFG split); `token_group` the members that split the
    tokens of its CFG share (None: the whole lane, or no token split)."""

    def __init__(self, seat: LaneSeat, cfg_group: Any = None, token_group: Any = None) -> None:
        if seat.shape.cfg not in (1, 2):
            raise ValueError(f"CFG-parallel splits a step over 2 devices, not {seat.shape.cfg}")
        self.seat, self.cfg_group, self.token_group = seat, cfg_group, token_group

    @property
    def leads(self) -> bool:
        return self.seat.leads

    @property
    def cfg(self) -> int:
        return self.seat.shape.cfg

    def owners(self, blocks: list[RowBlock]) -> list[int]:
        """The CFG share of each block: a guided request's positive rows on share 0, its
        negative rows on share 1; an unguided one that caches on share 0 (the lead: its
        residuals stay where it was computed, and the lead counts what it skipped); other
        unguided ones where fewer rows are so far."""
        rows = [0] * self.cfg
        owners = []
        guided = {id(block.state) for block in blocks if block.negative}
        for block in blocks:
            if self.cfg > 1 and id(block.state) in guided:
                owner = 1 if block.negative else 0
            elif block.state.cache is not None:
                owner = 0
            else:
                owner = min(range(self.cfg), key=lambda share: rows[share])
            rows[owner] += block.rows
            owners.append(owner)
        return owners

    def forward(self, blocks: list[RowBlock], run: RunBlocks) -> torch.Tensor:
        owners = self.owners(blocks)
        share = self.seat.cfg_rank
        # The members of one share take the same blocks, so they enter the denoiser's
        # token exchanges together (or, with nothing to run, all stay out).
        mine = [block for block, owner in zip(blocks, owners, strict=True) if owner == share]
        failure: Exception | None = None
        local = None
        summed = self._summed(owners)
        try:
            if mine:
                with denoiser_call(self._rows(blocks, owners), summed=summed):
                    local = run(mine)
        except Exception as exc:  # noqa: BLE001 - every device raises, below
            if self._exchanges_inside(blocks, summed):
                # Where this forward raised, the others may be inside one of its exchanges
                # (a token split's all-to-all, the cache's sum), which they would leave only
                # at the group's timeout: ending this member releases them now, and the lane
                # restarts. A failure every member meets alike is then not retried in halves.
                _broken(
                    f"this member's forward raised amid the lane's exchanges: {type(exc).__name__}: {exc}"
                )
            failure = exc
        self._agree(blocks, failure)
        if self.cfg == 1:
            assert local is not None, "without a CFG split every block is this share's"
            return local
        return self._gathered(blocks, owners, local)

    def _exchanges_inside(self, blocks: list[RowBlock], summed: Summed | None) -> bool:
        """Whether this step's forward exchanges with other members inside the denoiser: its
        tokens are split, or a request under First-Block Cache sums its figures over them."""
        cached = summed is not None and any(block.state.cache is not None for block in blocks)
        return self.seat.shape.sequence > 1 or cached

    def _rows(self, blocks: list[RowBlock], owners: list[int]) -> list[int] | None:
        """The rows of the step's batch (every block's, in order) this member runs; None
        where it runs them all."""
        if self.cfg == 1:
            return None
        rows: list[int] = []
        start = 0
        for block, owner in zip(blocks, owners, strict=True):
            if owner == self.seat.cfg_rank:
                rows.extend(range(start, start + block.rows))
            start += block.rows
        return rows

    def _summed(self, owners: list[int]) -> Summed | None:
        """How a forward's per-request figures are summed over the members that hold the
        same requests' rows or tokens: the whole lane where both CFG shares run rows, else
        the members that split this share's tokens; None where this member holds them all."""
        if self.cfg > 1 and len(set(owners)) > 1:
            group = None  # the default group: the whole lane
        elif self.seat.shape.sequence > 1:
            group = self.token_group
        else:
            return None

        def summed(figures: torch.Tensor) -> torch.Tensor:
            self._collective(lambda: torch.distributed.all_reduce(figures, group=group))
            return figures

        return summed

    def _agree(self, blocks: list[RowBlock], failure: Exception | None) -> None:
        """Tell every member of the lane whether its share ran and which step it was: every
        device raises if one failed; steps that differ mean the lane is broken."""
        device = blocks[0].latents.device
        mine = torch.tensor([0 if failure else 1, _checksum(blocks)], dtype=torch.int64, device=device)
        theirs = [torch.empty_like(mine) for _ in range(self.seat.size)]
        self._collective(lambda: torch.distributed.all_gather(theirs, mine))
        flags = torch.stack(theirs).cpu().tolist()  # a host sync per step: two integers per device
        if len({checksum for _, checksum in flags}) > 1:
            _broken("the devices of the lane were asked for different steps")
        if failure is not None:
            raise failure
        if not all(ok for ok, _ in flags):
            raise PeerStepError("another device of the lane failed its share of this step")

    def _gathered(
        self, blocks: list[RowBlock], owners: list[int], local: torch.Tensor | None
    ) -> torch.Tensor:
        """Every block's prediction, in block order: each share's, padded to one shape (the
        most rows any holds, the largest block's shape), gathered from both shares."""
        shape = [max(sizes) for sizes in zip(*(block.latents.shape[1:] for block in blocks), strict=True)]
        counts = [sum(b.rows for b, o in zip(blocks, owners, strict=True) if o == m) for m in range(self.cfg)]
        first = blocks[0].latents
        mine = first.new_zeros((max(counts), *shape))
        if local is not None:
            mine[(slice(0, local.shape[0]), *(slice(0, size) for size in local.shape[1:]))] = local
        shares = [torch.empty_like(mine) for _ in range(self.cfg)]
        self._collective(lambda: torch.distributed.all_gather(shares, mine, group=self.cfg_group))
        taken = [0] * self.cfg
        rows = []
        for block, owner in zip(blocks, owners, strict=True):
            rows.append(shares[owner][taken[owner] : taken[owner] + block.rows])
            taken[owner] += block.rows
        return torch.cat(rows)

    def _collective(self, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a member gone, or the group's timeout
            _broken(f"a collective of the lane failed: {type(exc).__name__}: {exc}")


def _checksum(blocks: list[RowBlock]) -> int:
    """Which step this is: each block's request, branch, rows and step, as one integer."""
    text = "|".join(
        f"{b.state.request.request_id}:{b.negative}:{b.rows}:{b.state.steps_done}" for b in blocks
    )
    return zlib.crc32(text.encode())


def _broken(reason: str) -> NoReturn:
    """The lane cannot go on together: end this member at once (no cleanup that could wait
    on the others); its supervisor sees it die and the group is restarted."""
    logger.error("%s; this member of the lane exits so that the lane restarts", reason)
    logging.shutdown()
    os._exit(BROKEN_LANE_EXIT)
