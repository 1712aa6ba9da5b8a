"""A SIMULATION, on CPU, of the map's lanes on one H200 (issue 38 item 1): how long soup-cli 0.77.0's
277-arm default map would take under the lanes' old card lock and under issue395.host.schedule's packing
by bytes, with 4, 6 and 8 lanes. Nothing here is measured by this script; it replays the committed
full map's own timings (results/map-077-full-h200-soup0.77.0-684477c/, 4 lanes x 4 threads, stopped
at its limit after 246 arms) through a discrete-event model of the lanes. The claim it gives an
expectation for: the whole map in at most 540 s of the tool's wall. Only a GPU run can check it.

The model, each part named where it is not the record's own figure:
- An arm is its row's setup, step and teardown seconds as measured in that run (the 31 arms it never
  reached are imputed: each family's step fitted on its measured arms against tokens, Moonlight's
  scaled from Qwen3.5-MoE by their 2048x1 steps in the committed serial MoE run; setup and teardown,
  the family's medians, its first arm of a quantization the measured first arm's). The first step of
  a lane process carries the CUDA warm-up; it moves with the lane's first arm.
- A lane starts after its imports (the committed lanes' first arm began 26-30 s in) and builds its
  first family's checkpoint at 2 bytes a parameter at the rate the committed first builds ran; then
  one family ahead, as host/checkpoints.py does. After a family's last arm its margin re-runs
  (measure/margin.py's margin_arms on its rows) run at the arm's own seconds.
- The card: issue395.host.schedule's Ledger over Room(the H200's total, live lanes). The old lock is
  the same ledger with an arm holding a lane's 1/N of the room, a whole-card arm all of it.
- Steps on the GPU: "overlap" lets steps run at once at their measured seconds (the committed run
  overlapped 2-4 steps for 67 s without a visible slow-down against the serial run); "one at a time"
  runs one step at a time (the issue's floor: the step seconds summed).
- Host cores: the 6 x 2 and 8 x 2 layouts are simulated at the 4 x 4 setup seconds and again at
  twice them (the CPU work of a setup on half the threads); neither is measured.

    .venv-soup077/bin/python bench/schedule_sim.py > results/schedule-sim-map-077.txt
"""

import heapq
import json
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.cards import CARDS, budget, Card  # noqa: E402
from issue395.estimator.estimate import estimate_key  # noqa: E402
from issue395.measure.margin import margin_arms  # noqa: E402
from issue395.model.registry import FAMILIES, MAP_FAMILIES, RELEASE_FAMILIES, SHAPES  # noqa: E402
from issue395.model.streaming import family_of
from issue395.record import MAP_BATCHES, QUANTS  # noqa: E402
from issue395.results.row import Row  # noqa: E402
from issue395.host.grid import arm_seconds, plan_map, shard_of  # noqa: E402
from issue395.host.schedule import Ledger, Need, Room, card_total, claim_order, may_build  # noqa: E402

RUN = ROOT / "results" / "map-077-full-h200-soup0.77.0-684477c"
#: the transformers release the committed map ran (its stack.txt, pip list), for the needs-free it packs by
TRANSFORMERS = next(ln.split()[1] for ln in (RUN / "stack.txt").read_text().splitlines() if ln.startswith("transformers "))
MOE = ROOT / "results" / "moe-and-stream-modes-h200-soup0.77.0-fcde6d3" / "moe-map.json"
H200 = CARDS["h200"]
#: soup-cli 0.77.0's default map: the ten, the release's three, Llama-3.1-8B's published NF4 arm
FAMILIES_077 = MAP_FAMILIES + RELEASE_FAMILIES + ("llama31-8b",)
CUT_S = 530.0  # the committed call's SIGINT: timeout -s INT 530 (commands.txt)
#: The disk the checkpoints may hold at once (a choice: the committed box's /tmp had 64 GiB free, stack.txt;
#: 60 GB leaves room for the logs and the arms' files)
DISK = 60 * 10**9
#: The disk of the box the next full map met (its stack.txt's `df -h /tmp`: 43G available, GiB), less the
#: headroom the lanes' disk ledger keeps (issue395/host/cardlock.DiskLedger): the budget it would have set
MET = ROOT / "results" / "pages2-soup-patch-map4-modes-h200-soup0.77.0-9d73b77" / "call-4" / "stack.txt"


def met_disk() -> int:
    from issue395.host.cardlock import DISK_HEADROOM_BYTES

    line = next(ln for ln in MET.read_text().splitlines() if ln.endswith(" /"))
    avail = line.split()[3]
    assert avail.endswith("G"), line
    return int(float(avail[:-1]) * 2**30) - DISK_HEADROOM_BYTES


@dataclass
class Arm:
    key: tuple  # (model_key, quant, seq, batch)
    index: int
    setup: float
    step: float
    teardown: float
    need: Need
    whole: bool = False  # the old lock: needs the card alone
    source: str = "measured"
    warm: float = 0.0  # the CUDA warm-up inside this measured step (a lane's first arm)
    rerun: bool = False  # a margin re-run: not a row of the map
    reserved: int = 0  # its row's max_memory_reserved (the default allocator the lanes run), 0 where not measured

    @property
    def family(self) -> str:
        return family_of(self.key[0])


def committed_rows() -> list[dict]:
    return [json.loads(line) for line in (RUN / "map-077-full.json.rows.jsonl").read_text().splitlines()]


def progress(rows: dict) -> list[tuple[float, tuple]]:
    """The committed run's progress lines: when each arm's row reached the parent, in order."""
    key_of = {(r["model"], q, sq, b): k for (_, q, sq, b), r in rows.items() for k in [(r["model_key"], q, sq, b)]}
    out = []
    pat = re.compile(r"^\[arm \d+/\d+\] (.+?)( nf4)? seq (\d+) batch (\d+): .*elapsed ([\d.]+) s")
    for line in (RUN / "map-077-full.txt").read_text().splitlines():
        m = pat.match(line)
        if m:
            out.append((float(m.group(5)), key_of[(m.group(1), "nf4" if m.group(2) else "none", int(m.group(3)),
                                                   int(m.group(4)))]))
    return out


def needs(key: tuple) -> Need:
    model, quant, seq, batch = key
    e = estimate_key(model, quant=quant, seq=seq, batch=batch, release="0.77.0",
                     transformers=TRANSFORMERS)  # the committed map's stack, not the installed one
    return Need(e.needs_free, e.soup_predicted)


def tokens(key: tuple) -> int:
    return key[2] * key[3]


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares step = a + b x tokens (b >= 0)."""
    if len({t for t, _ in points}) < 2:
        return statistics.median(s for _, s in points), 0.0
    b, a = statistics.linear_regression([t for t, _ in points], [s for _, s in points])
    return (a, b) if b >= 0 else (statistics.median(s for _, s in points), 0.0)


def arms_077() -> tuple[list[Arm], dict]:
    """The 277 arms with their seconds (measured or imputed) and needs; facts about the committed run."""
    rows = {(r["model_key"], r["quant"], r["seq"], r["batch"]): r for r in committed_rows()}
    seen = progress(rows)
    lane_first: dict[int, tuple] = {}
    for _, key in seen:
        lane_first.setdefault(rows[key]["ran"]["pid"], key)
    plan = plan_map(FAMILIES_077, QUANTS, None, MAP_BATCHES)
    first_of, index_of = {}, {(a.model, a.quant, a.seq, a.batch): a.index for a in plan}
    for a in plan:
        first_of.setdefault((family_of(a.model), a.quant), a.index)
    # per family: steps against tokens (not a lane's first arm), medians of later setups and teardowns
    fits, setups, firsts, tears = {}, {}, {}, {}
    for fam in FAMILIES_077:
        mine = [(k, r) for k, r in rows.items() if family_of(k[0]) == fam and r["failure"] is None]
        if not mine:
            continue
        later = [(k, r) for k, r in mine if k not in lane_first.values()]
        fits[fam] = {q: fit([(tokens(k), r["ran"]["timings"]["step_s"]) for k, r in later if k[1] == q] or
                            [(tokens(k), r["ran"]["timings"]["step_s"]) for k, r in later]) for q in QUANTS}
        setups[fam] = statistics.median([r["ran"]["timings"]["setup_s"] for k, r in mine
                                         if index_of[k] not in first_of.values()]
                                        or [r["ran"]["timings"]["setup_s"] for _, r in mine])
        firsts[fam] = {k[1]: r["ran"]["timings"]["setup_s"] for k, r in mine if index_of[k] == first_of[(fam, k[1])]}
        tears[fam] = statistics.median(r["ran"]["timings"]["teardown_s"] for _, r in mine)
    # Moonlight: no map row; scaled from Qwen3.5-MoE by their 2048x1 bf16 steps in the serial MoE run
    moe = {(r["model_key"], r["quant"], r["seq"], r["batch"]): r["timings"] for r in json.loads(MOE.read_text())["rows"]}
    scale = moe[("moonlight", "none", 2048, 1)]["step_s"] / moe[("qwen3.5-moe", "none", 2048, 1)]["step_s"]
    fits["moonlight"] = {q: (a * scale, b * scale) for q, (a, b) in fits["qwen3.5-moe"].items()}
    setups["moonlight"] = statistics.median(moe[("moonlight", q, 2048, 1)]["setup_s"] for q in QUANTS)
    firsts["moonlight"] = {q: moe[("moonlight", q, 512, 1)]["setup_s"] for q in QUANTS}
    tears["moonlight"] = statistics.median(moe[("moonlight", q, s, 1)]["teardown_s"] for q in QUANTS for s in (512, 2048))
    out = []
    for a in plan:
        key = (a.model, a.quant, a.seq, a.batch)
        r = rows.get(key)
        fam = family_of(a.model)
        if r is not None:
            t = r["ran"]["timings"]
            arm = Arm(key, a.index, t.get("setup_s") or 0.0, t.get("step_s") or 0.0, t.get("teardown_s") or 0.0,
                      needs(key), reserved=r.get("reserved") or 0)
            if key in lane_first.values():  # its step holds the process's CUDA warm-up
                fa, fb = fits[fam][a.quant]
                arm.warm = max(0.0, arm.step - (fa + fb * tokens(key)))
        else:
            fa, fb = fits[fam][a.quant]
            setup = firsts[fam].get(a.quant, setups[fam]) if a.index == first_of[(fam, a.quant)] else setups[fam]
            arm = Arm(key, a.index, setup, max(0.1, fa + fb * tokens(key)), tears[fam], needs(key), source="imputed")
        out.append(arm)
    first_setup = {}
    for a in out:
        first_setup.setdefault((a.family, a.key[1]), a.setup)
    facts = dict(first_setup=first_setup, first_start=min(t - sum(rows[k]["ran"]["timings"].get(x) or 0 for x in ("setup_s", "step_s", "teardown_s"))
                                 for t, k in seen[:4]),
                 reported=len(seen), last=seen[-1][0], by_cut=sum(1 for t, _ in seen if t <= CUT_S), rows=rows)
    return out, facts


def checkpoint_bytes(fam: str) -> int:
    """2 bytes a parameter (bf16), the registry's count or the derived shape's."""
    from issue395.host.grid import shape_params

    if fam in FAMILIES:
        return 2 * (FAMILIES[fam].params or shape_params(fam))
    return SHAPES[fam].checkpoint_bytes


def build_rate() -> float:
    """Bytes a second the committed lanes' first builds ran at (each lane's first family, built
    before any of its arms; the four 'built in' lines before the first arm's)."""
    text = (RUN / "map-077-full.txt").read_text()
    head = text.split("[arm 1/")[0]
    built = [float(s) for s in re.findall(r"built in ([\d.]+) s", head)]
    names = re.findall(r"building (.+?)'s synthetic checkpoint", head)
    by_name = {**{f.name: k for k, f in FAMILIES.items()}, **{s.name: k for k, s in SHAPES.items()}}
    return sum(checkpoint_bytes(by_name[n]) for n in names) / sum(built)


def margin_reruns(fam: str, arms: list[Arm], rows: dict) -> list[Arm]:
    """The family's margin re-runs: measure/margin.py's pick on its committed rows (one, its first
    arm's seconds, for a family with none: Moonlight)."""
    mine = [Row.from_json(r) for k, r in rows.items() if family_of(k[0]) == fam]
    by_index = {a.index: a for a in arms}
    if not mine:
        return [replace(arms[1] if len(arms) > 1 else arms[0], rerun=True)]
    picked = []
    for m in margin_arms(mine):
        a = next(x for x in arms if x.key == (m.model, m.quant, m.seq, m.batch))
        # its shards are cut: a re-run's setup is the family's later arms'
        picked.append(replace(by_index[a.index], setup=statistics.median(x.setup for x in arms[1:]) if len(arms) > 1
                              else a.setup, warm=0.0, rerun=True))
    return picked


@dataclass
class Policy:
    name: str
    lanes: int
    bytes_: bool  # True: each arm holds its needs-free (schedule); False: the old lock (1/N or the card)
    dynamic: bool  # True: lanes take families costliest first as they need one; False: dealt up front
    back_to_back: bool = False  # the old lock with main's CardHold: a family's whole-card arms last, one hold
    patience: float = 0.0
    setup_scale: float = 1.0
    gpu_slots: Optional[int] = None  # None: steps overlap; 1: one step at a time
    disk: Optional[int] = None  # bytes of checkpoints at once (None: not bounded, as the lanes are now)
    costliest_first: bool = False  # dealt: each lane takes its families costliest first (else grid order)
    reserved: bool = False  # each arm holds its row's measured reserved (the default allocator's), where larger


@dataclass
class Outcome:
    wall: float
    done_by_cut: int
    lane_ends: list
    gpu_busy: float
    steps_sum: float
    peak_disk: int
    busy: float  # lane-seconds in setup, step and teardown
    idle: float
    after: int = 0  # arms that fit no card beside the idle lanes: run after them, alone


def whole_card(arms: list[Arm], lanes: int) -> set:
    """The old lock's whole-card arms (host/spread.plan_lanes' rule): needs-free or Soup's number past a
    lane's 1/N of the card, unless Soup refuses it alone."""
    whole, lane = budget(Card("card", H200.total_bytes)), budget(Card("lane", H200.total_bytes // lanes))
    return {a.index for a in arms if not (a.need.soup > whole.harness_gate_free_bytes
                                          or (lane.fits(a.need.holds) and a.need.soup <= lane.harness_gate_free_bytes))}


def deal(arms: list[Arm], policy: Policy, whole: set, cost: dict) -> tuple[list, Optional[list]]:
    """Which lane runs which family: a dynamic policy's one pool, claimed costliest first as lanes need a
    family (dealt None); else each lane's families dealt up front as run/grid's shard_of deals them
    (pool empty), each lane's costliest first where the policy says so."""
    n = policy.lanes
    if policy.dynamic:
        return claim_order(cost), None
    from issue395.model.arm import Arm as GridArm
    grid = [GridArm(a.key[0], a.key[2], a.key[3], a.index, a.key[1]) for a in arms]
    dealt = [list(dict.fromkeys(family_of(g.model) for g in shard_of(grid, (k, n), whole_models=True)))
             for k in range(1, n + 1)]
    if policy.costliest_first:
        dealt = [claim_order({f: cost[f] for f in mine}) for mine in dealt]
    return [], dealt


class Simulation:
    """One simulated call's state, shared by its lanes: the event queue (time, then the order events
    were scheduled), the clock, the card's ledger, the disk the checkpoints hold, the GPU's steps, and
    what each lane and arm has done."""

    def __init__(self, arms: list[Arm], policy: Policy, facts: dict, rate: float):
        n = policy.lanes
        self.policy, self.facts, self.rate = policy, facts, rate
        families = list(dict.fromkeys(a.family for a in arms))
        self.by_fam = {f: [a for a in arms if a.family == f] for f in families}
        self.whole = whole_card(arms, n) if not policy.bytes_ else set()
        cost = {f: sum(arm_seconds(_ArmLike(a)) for a in self.by_fam[f]) for f in families}
        self.pool, self.dealt = deal(arms, policy, self.whole, cost)
        self.ledger = Ledger(self.room(n), patience=policy.patience)
        self.live = n
        self.events: list = []  # (time, seq, callback)
        self.seq = 0
        self.now = 0.0
        self.disk = [0, 0]  # on disk now, peak
        self.gpu = {"busy": 0, "queue": [], "intervals": []}
        self.lane_ends = [0.0] * n
        self.done_times: list[float] = []
        self.busy = 0.0
        self.waiting_start: dict = {}
        self.disk_wait: list = []
        self.warm = statistics.mean(a.warm for a in arms if a.warm) if any(a.warm for a in arms) else 0.0

    def room(self, live: int) -> Room:
        return Room(card_total(H200.total_bytes), live)

    def at(self, t, fn):
        """Schedule ``fn`` at time ``t`` (events at one time run in the order scheduled)."""
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def holds_of(self, a: Arm) -> Need:
        """What the arm holds of the card: its needs-free (or its measured reserved where larger and the
        policy says so) under bytes; under the old lock a lane's 1/N of the room, or all of it."""
        n = self.policy.lanes
        if self.policy.bytes_ and self.policy.reserved:
            return Need(max(a.need.holds, a.reserved), a.need.soup)
        if self.policy.bytes_:
            return a.need
        share = self.room(n).arm_bytes // n
        return Need(self.room(n).arm_bytes if a.index in self.whole else share)

    def admit(self):
        """Start every waiting arm the ledger admits now."""
        for key in self.ledger.admit(self.now):
            self.at(self.now, self.waiting_start.pop(key))

    def run(self) -> None:
        """Every lane started after its imports, events run in time order until none is left."""
        lanes = [SimLane(self, k) for k in range(self.policy.lanes)]
        for lane in lanes:
            self.at(self.facts["first_start"], lane.start)
        while self.events:
            t, _, fn = heapq.heappop(self.events)
            self.now = t
            fn()

    def run_after(self, after: list[Arm]) -> None:
        """The arms that fit no card beside the lanes: one fresh process after them, alone: its imports,
        each family's checkpoint again, its arms in turn."""
        policy, facts = self.policy, self.facts
        end = max(self.lane_ends)
        end += facts["first_start"]
        for fam in dict.fromkeys(a.family for a in after):
            end += checkpoint_bytes(fam) / self.rate
            for i, a in enumerate(x for x in after if x.family == fam):
                setup = facts["first_setup"][(fam, a.key[1])] if i == 0 else a.setup
                self.busy += setup * policy.setup_scale + a.step + a.teardown
                end += setup * policy.setup_scale + a.step + a.teardown
                self.gpu["intervals"].append((end - a.teardown - a.step, end - a.teardown))
                self.done_times.append(end)
        self.lane_ends.append(end)


class SimLane:
    """One simulated lane: it builds a family's checkpoint (the next one ahead where the disk holds it),
    runs the family's arms and re-runs as the ledger admits them, and exits when no family is left."""

    def __init__(self, sim: Simulation, k: int):
        self.sim = sim
        self.k, self.first, self.parked = k, True, False
        self.queue = list(sim.dealt[k]) if sim.dealt is not None else []
        self.next_build = None  # (family, ready time)

    def pending(self) -> list:
        """The families this lane may still take: its own dealt ones, or the shared pool."""
        return self.queue if self.sim.dealt is not None else self.sim.pool

    def take(self) -> Optional[str]:
        pending = self.pending()
        return pending.pop(0) if pending else None

    def start(self):
        s = self.sim
        fam = self.take()
        if fam is None:
            return self.exit()
        size = checkpoint_bytes(fam)
        s.disk[0] += size
        s.disk[1] = max(s.disk[1], s.disk[0])
        s.at(s.now + size / s.rate, lambda: self.family(fam, size))

    def family(self, fam, size):
        s = self.sim
        order = s.by_fam[fam]
        if s.policy.back_to_back and not s.policy.bytes_:
            order = sorted(order, key=lambda a: a.index in s.whole)
        self.next_build = None
        self.ahead()
        items = list(order) + s.facts["reruns"][fam]
        self.run(items, 0, fam, size, holding=False)

    def ahead(self):
        """The builder, one family ahead, where the disk holds it beside what is there."""
        s = self.sim
        if self.next_build is not None or not self.pending():
            return
        nxt = self.pending()[0]
        nsize = checkpoint_bytes(nxt)
        if not may_build(s.disk[0], nsize, s.policy.disk):
            if self not in s.disk_wait:
                s.disk_wait.append(self)
            return
        self.take()
        s.disk[0] += nsize
        s.disk[1] = max(s.disk[1], s.disk[0])
        self.next_build = (nxt, nsize, s.now + nsize / s.rate)
        if self.parked:  # it had nothing to run: it starts the family once built
            self.parked = False
            ready = self.next_build[2]
            s.at(ready, lambda: self.family(nxt, nsize))

    def released(self):
        for lane in list(self.sim.disk_wait):
            self.sim.disk_wait.remove(lane)
            lane.ahead()

    def run(self, items, i, fam, size, holding):
        """Run the family's arm ``i`` (held on from the last where it keeps the card, else once the
        ledger admits it); past the last, the family is done."""
        s = self.sim
        if i == len(items):
            return self.family_done(size, holding)
        a = items[i]
        keep = (s.policy.back_to_back and not s.policy.bytes_ and a.index in s.whole
                and i + 1 < len(items) and items[i + 1].index in s.whole)

        def go():
            self.arm(items, i, fam, size, keep)

        if holding:
            return go()
        s.waiting_start[self.k] = go
        s.ledger.ask(self.k, s.holds_of(a), s.now)
        s.admit()

    def family_done(self, size, holding):
        """The family's checkpoint leaves the disk; the lane goes on to the family built ahead, waits for
        disk room to build one, or exits."""
        s = self.sim
        if holding:
            s.ledger.done(self.k)
            s.admit()
        s.disk[0] -= size
        self.released()
        if self.next_build is None:
            if self in s.disk_wait:
                s.disk_wait.remove(self)
            self.ahead()
        if self.next_build is None:
            if self.pending():  # waits for disk room
                self.parked = True
                if self not in s.disk_wait:
                    s.disk_wait.append(self)
                return
            return self.exit()
        nxt, nsize, ready = self.next_build
        return s.at(max(s.now, ready), lambda: self.family(nxt, nsize))

    def arm(self, items, i, fam, size, keep):
        """One admitted arm: its setup, its step (on the GPU at once, or queued for a GPU slot), its
        teardown; then the ledger's hold released (unless kept for the next) and the next arm."""
        s = self.sim
        a = items[i]
        setup = a.setup * s.policy.setup_scale
        step = a.step - a.warm + (s.warm if self.first else 0.0)
        self.first = False
        t0 = s.now

        def stepped():
            def tear():
                s.busy += s.now - t0
                if not a.rerun:
                    s.done_times.append(s.now)
                if not keep:
                    s.ledger.done(self.k)
                    s.admit()
                self.run(items, i + 1, fam, size, holding=keep)
            s.at(s.now + a.teardown, tear)

        def step_now():
            s.gpu["busy"] += 1
            s0 = s.now

            def end():
                s.gpu["busy"] -= 1
                s.gpu["intervals"].append((s0, s.now))
                if s.gpu["queue"]:
                    s.gpu["queue"].pop(0)()
                stepped()
            s.at(s.now + step, end)

        def steps():
            if s.policy.gpu_slots is None or s.gpu["busy"] < s.policy.gpu_slots:
                step_now()
            else:
                s.gpu["queue"].append(step_now)
        s.at(s.now + setup, steps)

    def exit(self):
        s = self.sim
        s.lane_ends[self.k] = s.now
        s.live -= 1
        s.ledger.room = s.room(max(1, s.live))
        s.admit()


def union_seconds(intervals: list) -> float:
    """The seconds the sorted intervals cover together (a GPU busy with any step)."""
    union, cur = 0.0, None
    for a, b in intervals:
        if cur is None or a > cur[1]:
            union += cur[1] - cur[0] if cur else 0.0
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    union += cur[1] - cur[0] if cur else 0.0
    return union


def simulate(arms: list[Arm], policy: Policy, facts: dict, rate: float) -> Outcome:
    """One policy's simulated call: the lanes' event model over the arms that fit beside the lanes, then
    those that do not, alone; its wall, arms done by the committed call's cut, GPU and lanes' use, disk."""
    n = policy.lanes
    full = Room(card_total(H200.total_bytes), n)
    after = [a for a in arms if policy.bytes_ and not full.fits_beside_lanes(a.need)]
    arms = [a for a in arms if a not in after]
    sim = Simulation(arms, policy, facts, rate)
    sim.run()
    if after:
        sim.run_after(after)
    if sim.ledger.waiting:
        raise RuntimeError(f"{policy.name}: arms never admitted: {sim.ledger.waiting}")
    iv = sorted(sim.gpu["intervals"])
    wall = max(sim.lane_ends)
    return Outcome(wall, sum(1 for t in sim.done_times if t <= CUT_S), sim.lane_ends, union_seconds(iv),
                   sum(b - a for a, b in iv), sim.disk[1], sim.busy, n * wall - sim.busy, len(after))


class _ArmLike:
    """What grid.arm_seconds reads of an arm: its model (the scheduler's own rough cost, not the timings)."""

    def __init__(self, a: Arm):
        self.model = a.key[0]


def main() -> None:
    arms, facts = arms_077()
    rate = build_rate()
    facts["reruns"] = {f: margin_reruns(f, [a for a in arms if a.family == f], facts["rows"])
                       for f in dict.fromkeys(a.family for a in arms)}
    measured = [a for a in arms if a.source == "measured"]
    print("A SIMULATION, not a measurement: soup-cli 0.77.0's default map (277 arms) replayed through a model of the")
    print("lanes on one H200, from the committed full map's own timings (results/map-077-full-h200-soup0.77.0-684477c/,")
    print("4 lanes x 4 threads). Only a GPU run can say what the map takes; bench/gpu-map4.sh is that run.")
    print()
    print(f"arms: {len(arms)} ({len(measured)} with the committed run's seconds, {len(arms) - len(measured)} imputed: "
          + ", ".join(f"{FAMILIES[f].name} x{sum(1 for a in arms if a.family == f and a.source == 'imputed')}"
                      for f in dict.fromkeys(a.family for a in arms if a.source == "imputed")) + ")")
    s = {k: sum(getattr(a, k) for a in arms) for k in ("setup", "step", "teardown")}
    sm = {k: sum(getattr(a, k) for a in measured) for k in ("setup", "step", "teardown")}
    print(f"committed run (measured): {facts['by_cut']} arms reported by its SIGINT at {CUT_S:.0f} s of the call, "
          f"{CUT_S - facts['first_start']:.0f} s after its lanes' first arm began; {facts['reported']} by its last "
          f"progress line ({facts['last']:.1f} s); their seconds summed: setup {sm['setup']:.1f}, step {sm['step']:.1f}, "
          f"teardown {sm['teardown']:.1f}")
    print(f"the 277 arms' seconds summed (measured + imputed): setup {s['setup']:.1f}, step {s['step']:.1f} "
          f"(the step-time floor: one step at a time), teardown {s['teardown']:.1f}")
    print(f"model inputs (derived from the committed run): lanes start at {facts['first_start']:.1f} s (first arm's start); "
          f"checkpoints built at {rate / 1e9:.2f} GB/s; a lane's first step carries "
          f"{statistics.mean(a.warm for a in arms if a.warm):.1f} s of CUDA warm-up (mean of the four)")
    print()
    wired = dict(bytes_=True, dynamic=False, costliest_first=True)
    policies = [
        Policy("the committed run's lock: 1/N, or the whole card, per arm", 4, bytes_=False, dynamic=False),
        Policy("main's lock: a family's whole-card arms back to back", 4, bytes_=False, dynamic=False,
               back_to_back=True),
        Policy("bytes (schedule.Ledger), families dealt as main deals", 4, bytes_=True, dynamic=False),
        Policy("wired (map4): bytes, each lane's families costliest first", 4, **wired),
        Policy("  the same, each arm holding its row's reserved where larger", 4, **dict(wired, reserved=True)),
        Policy("  the same, families claimed live costliest first (not wired)", 4, **dict(wired, dynamic=True)),
    ]
    met = met_disk()
    policies.append(Policy(f"  the same, the disk held to {met / 1e9:.1f} GB (the next call's box; wired)", 4,
                           **dict(wired, disk=met)))
    for n in (6, 8):
        policies.append(Policy("wired (map4)", n, **wired))
        policies.append(Policy(f"  the same, the disk held to {DISK // 10**9} GB", n, **dict(wired, disk=DISK)))
        policies.append(Policy("  the same, and setups twice as long (half the threads)", n,
                               **dict(wired, disk=DISK, setup_scale=2.0)))
    header = f"{'policy':64} {'lanes':>5} {'gpu':>11} {'wall s':>7} {'by 530 s':>8} {'GPU busy s':>10} {'lanes idle':>10} {'disk GB':>7} {'after':>5}"
    print(header)
    print("-" * len(header))
    for pol in policies:
        for slots in (None, 1):
            o = simulate(arms, replace(pol, gpu_slots=slots), facts, rate)
            print(f"{pol.name:64} {pol.lanes:>5} {'overlap' if slots is None else 'one at time':>11} {o.wall:>7.1f} "
                  f"{o.done_by_cut:>8} {o.gpu_busy:>10.1f} {o.idle / (pol.lanes * o.wall):>9.0%} {o.peak_disk / 1e9:>7.1f} {o.after:>5}")
    print()
    print("wall s: the simulated tool's wall from its start to the last lane's exit (lanes start together; the parent's")
    print("own imports and the outputs' writing are not in it). by 530 s: arms done by the committed call's SIGINT: the")
    print(f"first row is the check of the model against the committed run ({facts['by_cut']} measured). GPU busy: the union of")
    print("the simulated steps. lanes idle: of lanes x wall. disk GB: checkpoints on the disk at once (2 bytes a parameter,")
    print("the streamed layer's size times the depth: above the real size where a model's layers differ). after: arms that")
    print("fit no card beside the other lanes' contexts (run after the lanes, alone, in a fresh process).")


if __name__ == "__main__":
    main()
