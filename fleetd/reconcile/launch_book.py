"""Record what CreateFleet answered: the instances it launched, at the prices they were bought
at (state and ledger), the pools it refused (unavailable for that market for a while), and whether
spot is available again. The pass calls it when it awaited the launch itself; the cloud-call task
calls it under the pass lock when the answer comes."""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.adapters.aws_errors import AwsError, CapacityUnavailable, PermanentAwsError, Throttled
from fleetd.adapters.ec2 import LaunchResult, LaunchSpec
from fleetd.adapters.pricing import PriceSource
from fleetd.policy.memory import after_spot_launch
from fleetd.policy.model import Launch, Market, PoolId
from fleetd.reconcile import state as st
from fleetd.reconcile.ledger_feed import LedgerFeed
from fleetd.reconcile.memory_meta import load_memory, store_memory
from fleetd.reconcile.outcome import Outcome, count_aws_error
from fleetd.reconcile.prices import price_of
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LaunchBook:
    state: StateBackend
    prices: PriceSource
    ledger: LedgerFeed | None
    capacity_error_ttl_s: float  # how long a refused pool is left out (capacity.capacity_error_ttl_s)

    async def answer(
        self, action: Launch, spec: LaunchSpec, result: LaunchResult | None, exc: AwsError | None, now: float
    ) -> Outcome:
        if isinstance(exc, CapacityUnavailable):
            # A call-level capacity error does not say which pool: all of them were refused.
            for pool in action.pools:
                await self.pool_failed(pool, action.market, exc.code, now)
            await self.state.settle_launch(spec.token, st.FAILED, (), now, f"{exc.code}: {exc.message}")
            await self._spot_outcome(action, got_any=False, now=now)
            count_aws_error(exc)
            return Outcome(action, "failed", exc.code)
        if isinstance(exc, (Throttled, PermanentAwsError)):
            # Definitely not launched: AWS refused the call as a whole.
            await self.state.settle_launch(spec.token, st.FAILED, (), now, f"{exc.code}: {exc.message}")
            raise exc
        if exc is not None:
            # Transient errors propagate with the intent left open: the call may have gone through,
            # so the next pass resolves it by tag (or re-sends the same token).
            raise exc
        assert result is not None
        return await self._launched(action, spec, result, now)

    async def _launched(self, action: Launch, spec: LaunchSpec, result: LaunchResult, now: float) -> Outcome:
        prices = await self.prices.prices(sorted({i.pool for i in result.instances}), now)
        await self.state.record_launched(
            [
                st.SeenInstance(
                    i.instance_id,
                    i.pool,
                    i.market,
                    i.state,
                    i.launched_at or now,
                    spec.token,
                    price_of(i.market, prices.get(i.pool)) or action.budgeted_price_per_hour,
                )
                for i in result.instances
            ],
            spec.max_price_per_hour,
            now,
        )
        ids = tuple(i.instance_id for i in result.instances)
        if self.ledger is not None:
            await self.ledger.started(await self.state.instances(), ids, prices)
        for f in result.failures:
            count_aws_error(AwsError("CreateFleet", f.code, f.message), kind=f.kind)
            if f.kind == "capacity" and f.pool is not None:
                await self.pool_failed(f.pool, action.market, f.code, now)
            else:
                log.warning("launch_pool_error", pool=str(f.pool), code=f.code, kind=f.kind, error=f.message)
        status = st.LAUNCHED if ids else st.FAILED
        detail = "; ".join(f"{f.pool}: {f.code}" for f in result.failures)
        await self.state.settle_launch(spec.token, status, ids, now, detail)
        await self._spot_outcome(action, got_any=bool(ids), now=now)
        log.info(
            "launched",
            token=spec.token,
            requested=action.count,
            got=len(ids),
            instances=list(ids),
            pools=sorted({str(i.pool) for i in result.instances}),
            failures=detail or None,
            already_launched=result.already_launched,
        )
        if len(ids) >= action.count:
            return Outcome(action, "done", instance_ids=ids)
        return Outcome(action, "partial" if ids else "failed", detail, ids)

    async def pool_failed(self, pool: PoolId, market: Market, code: str, now: float) -> None:
        """The pool is unavailable for the launch's market only (spot and on-demand capacity
        run out independently)."""
        until = now + self.capacity_error_ttl_s
        await self.state.mark_pool_unavailable(pool, until, code, market)
        log.warning(
            "pool_unavailable",
            pool=str(pool),
            market=str(market),
            code=code,
            until=until,
            ttl_s=self.capacity_error_ttl_s,
        )

    async def _spot_outcome(self, action: Launch, *, got_any: bool, now: float) -> None:
        if action.market is not Market.SPOT:
            return
        memory = await load_memory(self.state)
        changed = after_spot_launch(memory, got_any, now)
        since, after = memory.spot_unavailable_since, changed.spot_unavailable_since
        if after == since:
            return
        await store_memory(self.state, memory, changed)
        if since is not None:  # after is None: a spot launch got capacity
            log.info("spot_available_again", unavailable_for_s=now - since)
        else:
            log.warning("spot_unavailable", pools=[str(p) for p in action.pools])
