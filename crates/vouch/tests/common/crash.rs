//! The crash workload the process-crash tests share (serve_crash.rs,
//! replica_crash.rs): a deterministic libnbd client that writes, zeroes,
//! trims, flushes and FUA-writes blocks whose content encodes (block,
//! write), SIGKILLs a process at a seeded moment with requests in flight,
//! and records what each block may read afterwards.

use std::time::Duration;

/// One cycle: verify the state left by the previous cycle, then (when
/// kill_after > 0) run the workload and SIGKILL process `pid` after
/// `kill_after` requests were issued. Arguments: URI PID STATE SEED CYCLE
/// KILL_AFTER BLOCKS [AFTER_KILL]. With AFTER_KILL > 0 the killed process
/// is not the server (a mirror's replica): the client goes on to issue
/// AFTER_KILL more requests, waits for every answer, and also writes
/// STATE.at_kill, what each block may read on a copy that stopped taking
/// writes at the kill (the killed replica's own volume). Prints one JSON
/// line.
pub const WORKLOAD: &str = r#"
import random
uri, pid, state_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seed, cycle, kill_after, nblocks = (int(a) for a in sys.argv[4:8])
after_kill = int(sys.argv[8]) if len(sys.argv) > 8 else 0
ZERO = -1
rng = random.Random(seed)
state = json.load(open(state_path)) if os.path.exists(state_path) else {"allowed": {}}
h = connect(uri)

def decode(lba, block):
    if block == bytes(4096):
        return ZERO
    magic, who, tag = struct.unpack_from("<4sQQ", block)
    if magic == b"VCH1" and who == lba and block == block_data(lba, tag):
        return tag
    return None

# 1. Every block must hold a value the contract allows.
violations, baseline = [], {}
CHUNK = 64
for start in range(0, nblocks, CHUNK):
    try:
        data = h.pread(CHUNK * 4096, start * 4096)
    except nbd.Error as e:
        violations.append({"lbas": [start, start + CHUNK], "read_error": err_info(e)})
        continue
    for i in range(CHUNK):
        lba = start + i
        tag = decode(lba, data[i * 4096:(i + 1) * 4096])
        allowed = state["allowed"].get(str(lba), [ZERO])
        if tag is None or tag not in allowed:
            violations.append({"lba": lba, "got": "garbage" if tag is None else tag,
                               "allowed": allowed})
        baseline[lba] = tag
if kill_after == 0 or violations:
    print(json.dumps({"violations": violations, "issued": 0}))
    sys.exit(0)

# 2. The workload. Per block: the tags written this cycle in issue order
# (never two requests in flight on one block), the index of the last
# acknowledged one, and the index of the last durable one (flushed after its
# acknowledgement, or FUA).
flush_prob = rng.choice([0.002, 0.01, 0.03, 0.1])
fua_prob = rng.choice([0.0, 0.02, 0.1])
hot = 64
writes, last_acked, durable = {}, {}, {}
busy, inflight = set(), {}
issued, acked_writes, acked_flushes, failed = 0, 0, 0, []

def complete(info):
    global acked_writes, acked_flushes
    if info[0] == "flush":
        acked_flushes += 1
        for lba, idx in info[1].items():
            if idx > durable.get(lba, -1):
                durable[lba] = idx
        return
    _, pairs, fua = info
    acked_writes += 1
    for lba, idx in pairs:
        busy.discard(lba)
        last_acked[lba] = max(last_acked.get(lba, -1), idx)
        if fua:
            durable[lba] = max(durable.get(lba, -1), idx)

def fail(info, error):
    # Answered with an error: not acknowledged, so the block may read it
    # or its previous value (its tag stays among the allowed ones).
    failed.append(err_info(error))
    if info[0] == "write":
        for lba, _ in info[1]:
            busy.discard(lba)

def allowed_now():
    """What a process crash keeps now: a block reads its last acknowledged
    value or a later one; requests still in flight (or answered but not
    yet seen) may or may not have happened."""
    allowed, acked_unflushed = {}, 0
    for lba in range(nblocks):
        tags = writes.get(lba, [])
        if lba in last_acked:
            allowed[lba] = sorted(set(tags[last_acked[lba]:]))
            acked_unflushed += last_acked[lba] > durable.get(lba, -1)
        else:
            allowed[lba] = sorted(set([baseline[lba]] + tags))
    return allowed, acked_unflushed

def save(path, allowed):
    with open(path + ".tmp", "w") as f:
        json.dump({"allowed": {str(k): v for k, v in allowed.items()}}, f)
    os.replace(path + ".tmp", path)

killed, at_kill = False, None
while True:
    while len(inflight) < 16:
        if issued == kill_after and not killed:
            os.kill(pid, signal.SIGKILL)
            killed = True
            if after_kill == 0:
                break
            at_kill = allowed_now()
            save(state_path + ".at_kill", at_kill[0])
        if killed and issued >= kill_after + after_kill:
            break
        if rng.random() < flush_prob:
            inflight[h.aio_flush()] = ("flush", dict(last_acked))
            issued += 1
            continue
        n = rng.choice([1, 1, 1, 1, 2, 3, 8, 31, 64, 256])
        if rng.random() < 0.5:
            lba = rng.randrange(0, hot)
        else:
            lba = rng.randrange(0, nblocks - n + 1)
        n = min(n, nblocks - lba)
        lbas = range(lba, lba + n)
        if any(l in busy for l in lbas):
            continue
        tag = cycle * 1000000 + issued
        kind = rng.random()
        fua = rng.random() < fua_prob
        flags = nbd.CMD_FLAG_FUA if fua else 0
        if kind < 0.06:
            cookie = h.aio_zero(n * 4096, lba * 4096, flags=flags)
            tag = ZERO
        elif kind < 0.10:
            cookie = h.aio_trim(n * 4096, lba * 4096, flags=flags)
            tag = ZERO
        else:
            data = b"".join(block_data(l, tag) for l in lbas)
            cookie = h.aio_pwrite(data, lba * 4096, flags=flags)
        pairs = []
        for l in lbas:
            writes.setdefault(l, []).append(tag)
            pairs.append((l, len(writes[l]) - 1))
            busy.add(l)
        inflight[cookie] = ("write", pairs, fua)
        issued += 1
    # The server was killed: what is in flight stays unanswered.
    if killed and after_kill == 0:
        break
    if not inflight:
        break
    h.poll(-1)
    for cookie in list(inflight):
        try:
            done = h.aio_command_completed(cookie)
        except nbd.Error as e:
            fail(inflight.pop(cookie), e)
            continue
        if done:
            complete(inflight.pop(cookie))

# 3. What each block may read after the crash.
allowed, acked_unflushed = allowed_now()
save(state_path, allowed)
print(json.dumps({"violations": [], "issued": issued, "in_flight": len(inflight),
                  "acked_writes": acked_writes, "acked_flushes": acked_flushes,
                  "durable_blocks": len(durable),
                  "acked_unflushed": (at_kill or (None, acked_unflushed))[1],
                  "failed": failed, "flush_prob": flush_prob}))
"#;

/// The workload's arguments for one cycle: the server at `uri`, process
/// `pid` killed after `kill_after` requests (0: only verify), the state
/// file `state`, a volume of `blocks` blocks, `after_kill` requests more
/// after the kill.
pub struct Cycle<'a> {
    pub uri: &'a str,
    pub pid: u32,
    pub state: &'a std::path::Path,
    pub seed: u64,
    pub cycle: u64,
    pub kill_after: u64,
    pub blocks: u64,
    pub after_kill: u64,
}

impl<'a> Cycle<'a> {
    /// A cycle that only verifies every block against `state`.
    pub fn verify(uri: &'a str, state: &'a std::path::Path, blocks: u64) -> Cycle<'a> {
        Cycle {
            uri,
            pid: 0,
            state,
            seed: 0,
            cycle: 0,
            kill_after: 0,
            blocks,
            after_kill: 0,
        }
    }

    /// The workload's command-line arguments.
    pub fn args(&self) -> Vec<String> {
        vec![
            self.uri.to_string(),
            self.pid.to_string(),
            super::s(self.state).to_string(),
            self.seed.to_string(),
            self.cycle.to_string(),
            self.kill_after.to_string(),
            self.blocks.to_string(),
            self.after_kill.to_string(),
        ]
    }
}

/// The workload's JSON line, after asserting it ran and found every block
/// as the contract allows; `context` and `log` go into the failure.
pub fn cycle_result(output: &std::process::Output, context: &str, log: &str) -> serde_json::Value {
    assert!(
        output.status.success(),
        "{context}: workload failed:\n{}",
        super::text(output)
    );
    let result: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{context}: workload output ({e}):\n{}", super::text(output)));
    assert_eq!(
        result["violations"],
        serde_json::json!([]),
        "{context}: blocks read values the contract forbids\n{log}"
    );
    result
}

/// How long one workload cycle may take (a hang guard).
pub const CYCLE_TIMEOUT: Duration = Duration::from_secs(60);

/// splitmix64: the per-cycle seeds and kill points.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
