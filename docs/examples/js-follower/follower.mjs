// A follower of one vLLM KV-event publisher, written from
// docs/snapshot-protocol.md alone: subscribe first; recover by an
// epoch-checked replay from the next seq, else a snapshot; apply live
// batches in seq order; recover on a gap, a restart, or an idle status
// that shows batches it never got; while the engine does not answer, mark
// the view stale and try again after a pause, for as long as it takes.
//
//   npm ci --ignore-scripts && node follower.mjs --endpoint tcp://HOST:5557 \
//       --replay-endpoint tcp://HOST:6557
//
// (--ignore-scripts: the zeromq package carries its compiled addon; its
// install script would only try a source build, which downloads.)
//
// Prints a JSON state line every --interval seconds. Reads JSON lines on
// stdin: {"match": [token ids]} answers {"match": N}, the leading full
// blocks held in one (medium, group), once caught up with the engine.
import { createHash } from "node:crypto";
import { createInterface } from "node:readline";
import { parseArgs } from "node:util";
import { decode, encode } from "@msgpack/msgpack";
import { Dealer, Subscriber } from "zeromq";

const { values: opts } = parseArgs({
  options: {
    endpoint: { type: "string" },
    "replay-endpoint": { type: "string" },
    interval: { type: "string", default: "1" },
  },
});
const U64 = { useBigInt64: true }; // hashes and the epoch are unsigned 64-bit
const END_SEQ = 0xffffffffffffffffn; // the 8 bytes of -1
const TIMEOUT_MS = 5000;
const IDLE_MS = 1000;

class NoReply extends Error {}

// -- the view: a set and a count per key, the index of plain stores --------
const view = {
  semantics: "physical",
  set: new Set(),
  count: new Map(),
  index: new Map(), // "tier|parent|tokens" -> hash
  announced: new Map(), // key -> its index entry
  blockSize: new Map(), // tier -> block size
  unknownRemovals: 0, // of keys not held: the stream is not the one followed
};
const held = (key) =>
  view.semantics === "physical" ? view.count.has(key) : view.set.has(key);

function apply(event) {
  if (event.type === "AllBlocksCleared") {
    for (const part of [view.set, view.count, view.index, view.announced]) part.clear();
    return;
  }
  const tier = `${event.medium ?? null}|${event.group_idx ?? null}`;
  event.block_hashes.forEach((hash, i) => {
    const key = `${tier}|${hash}`;
    if (event.type === "BlockStored") {
      const isNew = !held(key);
      view.set.add(key);
      view.count.set(key, (view.count.get(key) ?? 0) + 1);
      const size = event.block_size;
      const plain = event.lora_name == null && !(event.extra_keys ?? []).some((k) => k != null);
      if (isNew && plain && size > 0 && event.token_ids.length === size * event.block_hashes.length) {
        const parent = i ? event.block_hashes[i - 1] : event.parent_block_hash;
        const entry = `${tier}|${parent ?? null}|${event.token_ids.slice(i * size, (i + 1) * size)}`;
        view.index.set(entry, String(hash));
        view.announced.set(key, entry);
        view.blockSize.set(tier, size);
      }
    } else {
      if (!held(key)) view.unknownRemovals += 1;
      view.set.delete(key);
      const n = view.count.get(key) ?? 0;
      if (n > 1) view.count.set(key, n - 1);
      else view.count.delete(key);
      if (!held(key)) {
        const entry = view.announced.get(key);
        if (entry && view.index.get(entry) === String(hash)) view.index.delete(entry);
        view.announced.delete(key);
      }
    }
  });
}

function match(tokens) {
  let best = 0;
  for (const [tier, size] of view.blockSize) {
    let parent = null;
    let blocks = 0;
    for (let start = 0; start + size <= tokens.length; start += size) {
      const hash = view.index.get(`${tier}|${parent}|${tokens.slice(start, start + size)}`);
      if (hash === undefined) break;
      blocks += 1;
      parent = hash;
    }
    best = Math.max(best, blocks);
  }
  return best;
}

// -- the replay socket: one request at a time, one end message each --------
let dealer;
function freshDealer() {
  dealer?.close();
  dealer = new Dealer({ receiveTimeout: TIMEOUT_MS, linger: 0 });
  dealer.connect(opts["replay-endpoint"]);
}
freshDealer();

async function request(map) {
  await dealer.send(["", encode(map, U64)]);
  const batches = [];
  for (;;) {
    let frames;
    try {
      frames = await dealer.receive();
    } catch {
      freshDealer(); // a late answer must not be read as the next one's
      throw new NoReply(`no answer from ${opts["replay-endpoint"]} in ${TIMEOUT_MS} ms`);
    }
    const [, , seqFrame, payload] = frames;
    const seq = seqFrame.readBigUInt64BE();
    if (seq === END_SEQ) return { batches, end: decode(payload, U64) };
    batches.push([Number(seq), payload]);
  }
}

const applyBatch = (payload) => decode(payload, U64)[1].forEach(apply);

// -- following -------------------------------------------------------------
const state = { epoch: null, nextSeq: null, synced: false, staleSince: null };
const recoveries = { replay: 0, snapshot: 0 };
const live = new Subscriber({ receiveTimeout: 100 });
live.subscribe();
live.connect(opts.endpoint);

async function status() {
  const { end } = await request({ op: "status" });
  view.semantics = end.copy_semantics;
  return end;
}

async function replay(startSeq) {
  const { batches, end } = await request({ op: "replay", start_seq: startSeq, epoch: state.epoch });
  const seqs = batches.map(([seq]) => seq);
  const whole = end.status === "ok" && seqs.length === end.next_seq - startSeq &&
    seqs.every((seq, i) => seq === startSeq + i);
  if (!whole) return false;
  for (const [, payload] of batches) applyBatch(payload);
  state.nextSeq = end.next_seq;
  recoveries.replay += 1;
  return true;
}

async function snapshot() {
  for (let pause = 1000; ; pause = Math.min(2 * pause, 30000)) {
    const { batches, end } = await request({ op: "snapshot" });
    if (end.status === "ok" && batches.length === end.batches) {
      for (const [, payload] of batches) applyBatch(payload);
      [state.epoch, state.nextSeq] = [BigInt(end.epoch), end.resume_seq];
      recoveries.snapshot += 1;
      return;
    }
    const s = await status(); // refused while busy or stalled: ask again
    if (end.status === "refused" && !s.snapshot.enabled && !s.snapshot.stalled)
      throw new NoReply(`snapshot refused: ${end.reason}`);
    await new Promise((r) => setTimeout(r, pause * (0.8 + 0.4 * Math.random())));
  }
}

async function recover(s) {
  state.synced = false;
  s ??= await status();
  if (state.epoch !== BigInt(s.epoch)) state.nextSeq = null; // a restart
  if (state.nextSeq === null && s.oldest_seq === 0 && !s.snapshot.enabled) {
    apply({ type: "AllBlocksCleared" }); // snapshots off: replay the epoch from 0
    [state.epoch, state.nextSeq] = [BigInt(s.epoch), 0];
  }
  if (state.nextSeq === null || !(await replay(state.nextSeq))) await snapshot();
  state.synced = true;
  state.staleSince = null;
}

// Live batches wait in the SUB socket's queue while a request runs; those
// before the resume seq are in what was recovered.
async function onLive(seq, payload) {
  if (!state.synced || seq < state.nextSeq) {
    if (state.synced) {
      const s = await status(); // a duplicate, or a restarted engine
      if (BigInt(s.epoch) !== state.epoch) await recover(s);
    }
    return;
  }
  if (seq > state.nextSeq) return recover(); // a gap
  const unknown = view.unknownRemovals;
  applyBatch(payload);
  state.nextSeq = seq + 1;
  if (view.unknownRemovals > unknown) {
    // A restart whose new epoch reached our seq before we saw it?
    const s = await status();
    if (BigInt(s.epoch) !== state.epoch) await recover(s);
  }
}

async function sync() {
  const s = await status();
  if (!state.synced || BigInt(s.epoch) !== state.epoch) return recover(s);
  const until = Date.now() + 50; // a batch may be on its way
  while (state.nextSeq < s.next_seq && Date.now() < until) await readLive(10);
  if (state.nextSeq < s.next_seq) await recover(s);
  state.staleSince = null;
}

async function readLive(timeoutMs) {
  live.receiveTimeout = timeoutMs;
  try {
    const [, seqFrame, payload] = await live.receive();
    await onLive(Number(seqFrame.readBigUInt64BE()), payload);
    return true;
  } catch (e) {
    if (e instanceof NoReply) throw e;
    if (e.code !== "EAGAIN") throw e;
    return false;
  }
}

function printState() {
  const keys = [...(view.semantics === "physical" ? view.count.keys() : view.set)].sort();
  console.log(JSON.stringify({
    epoch: state.epoch === null ? null : `0x${state.epoch.toString(16).padStart(16, "0")}`,
    next_seq: state.nextSeq,
    synced: state.synced && state.staleSince === null,
    stale_since: state.staleSince,
    recoveries,
    keys: keys.length,
    keys_sha256: createHash("sha256").update(keys.join("\n")).digest("hex"),
  }));
}

// A container stop: the last state, then exit 0.
process.on("SIGTERM", () => {
  printState();
  process.exit(0);
});

const matches = [];
createInterface({ input: process.stdin }).on("line", (line) => matches.push(JSON.parse(line).match));

let retryAt = 0;
let pause = 1000;
let lastLive = Date.now();
let lastState = 0;
for (;;) {
  try {
    if (Date.now() >= retryAt) {
      if (state.staleSince !== null || !state.synced || Date.now() - lastLive > IDLE_MS || matches.length) {
        await sync();
        lastLive = Date.now();
        pause = 1000;
      }
    }
    if (!matches.length && (await readLive(100))) lastLive = Date.now();
  } catch (e) {
    if (!(e instanceof NoReply)) throw e;
    state.staleSince ??= new Date().toISOString(); // the engine is down: stale
    retryAt = Date.now() + pause * (0.8 + 0.4 * Math.random());
    pause = Math.min(2 * pause, 30000);
    console.log(`anomaly: stale: ${e.message}`);
  }
  // A stale view matches nothing: the engine may be gone.
  const fresh = state.synced && state.staleSince === null;
  for (const tokens of matches.splice(0)) console.log(JSON.stringify({ match: fresh ? match(tokens) : 0 }));
  if (Date.now() - lastState >= 1000 * Number(opts.interval)) {
    printState();
    lastState = Date.now();
  }
}
