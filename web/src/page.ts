// The page a person opens on a phone (dist/page.js, served by clients/gateway.py with
// web/page.html): consent, then the phone joins the gateway, trains each round the server
// asks for against the trunk, and shows what it is doing. One WebSocket to the gateway
// carries JSON (join, tasks, progress, results); the trunk gets its own, binary frames.
import * as tf from "@tensorflow/tfjs";
import { startBackend } from "./backends";
import { float32FromBytes, fromBase64, toBase64, Values } from "./codec";
import { Picture, picturesData, picturesId, readPicture } from "./pictures";
import { DeviceStages, Release, SgdOptions, StagesDescription, State } from "./stages";
import { trainBatch, trainUShapedBatch } from "./steps";
import { TrunkRefused, TrunkSocket } from "./trunk";

const TASK_FORMAT = "splitlearn.web.task/1";
/** localStorage key of this phone's place at the gateway (kept to rejoin as the same node). */
const DEVICE_KEY = "splitlearn-device";
/** localStorage key of the person's own pictures and labels (kept across reloads). */
const PICTURES_KEY = "splitlearn-pictures";
/** Most pictures a phone trains on (clients/steps/web.py: MAX_OWN_EXAMPLES). */
const MAX_PICTURES = 2000;
const RETRY_MS = 3000;
/** Batches of a round whose memory is measured (tf.profile costs time on each one). */
const MEASURED_BATCHES = 3;

interface Task {
  format: string;
  round: number;
  cut: number;
  parts: StagesDescription[];
  sgd: SgdOptions;
  trunk: { url: string; token: string; proof: string | null };
  data: { id: string; shape: number[]; inputs?: string; labels?: number[]; own?: boolean;
          light_on_dark?: boolean; classes?: number };
  batches: number[][];
  release: Release | null;
  deadline_s: number | null;
  least_steps: number;
}

interface Data {
  id: string;
  shape: number[];
  rows: Float32Array;
  labels: number[];
}

const view = {
  get: (id: string) => document.getElementById(id) as HTMLElement,
  set(id: string, text: string) {
    const element = document.getElementById(id);
    if (element) element.textContent = text;
  },
};

let gateway: WebSocket | null = null;
let data: Data | null = null;
/** The person's own pictures, when they chose to train on them (null: the assigned data). */
let pictures: Picture[] | null = null;
let leaving = false;
let busy = false;

function joinToken(): string | null {
  return new URLSearchParams(location.search).get("token");
}

function gatewayUrl(): string {
  return `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/phone`;
}

function send(message: object): void {
  if (gateway && gateway.readyState === WebSocket.OPEN) gateway.send(JSON.stringify(message));
}

function showState(text: string): void {
  view.set("state", text);
}

function formatBytes(bytes: number): string {
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1024 ** 2) return `${(bytes / 1024).toFixed(1)} KiB`;
  return `${(bytes / 1024 ** 2).toFixed(1)} MiB`;
}

/** The id of the data this phone trains on (null: none yet). */
function heldId(): string | null {
  return pictures ? picturesId(pictures) : data?.id ?? null;
}

/** Keep the task's data (sent once per phone and partition), or check the one held. */
function takeData(task: Task): Data {
  const given = task.data;
  if (given.own) { // the person's pictures, in the run's input format (built once)
    if (!pictures || picturesId(pictures) !== given.id) {
      throw new Error("the task's pictures are not the ones on this phone");
    }
    if (data?.id !== given.id) {
      const { rows, labels } = picturesData(pictures, given.shape, given.light_on_dark ?? false,
                                            given.classes ?? 0);
      data = { id: given.id, shape: given.shape, rows, labels };
    }
  } else if (given.inputs !== undefined && given.labels !== undefined) {
    const decoded = encodedRows(given.shape, given.inputs);
    data = { id: given.id, shape: given.shape, rows: decoded, labels: given.labels };
    send({ holds: given.id });
  }
  if (!data || data.id !== given.id) throw new Error("the task's data is not on this phone");
  return data;
}

function encodedRows(shape: number[], base64: string): Float32Array {
  const rows = float32FromBytes(fromBase64(base64));
  if (rows.length !== shape.reduce((a, b) => a * b, 1)) {
    throw new Error(`the data has ${rows.length} values, its shape [${shape}] needs more`);
  }
  return rows;
}

function batchOf(held: Data, indices: number[]): { inputs: Values; labels: number[] } {
  const sample = held.shape.slice(1).reduce((a, b) => a * b, 1);
  const values = new Float32Array(indices.length * sample);
  indices.forEach((row, i) => {
    if (!(row >= 0 && row < held.labels.length)) throw new Error(`row ${row} is not in the data`);
    values.set(held.rows.subarray(row * sample, (row + 1) * sample), i * sample);
  });
  return { inputs: { shape: [indices.length, ...held.shape.slice(1)], values },
           labels: indices.map((row) => held.labels[row]) };
}

/** Train the task's batches against the trunk; the result the gateway relays. */
async function runTask(task: Task): Promise<object> {
  if (task.format !== TASK_FORMAT) throw new Error(`a task of format ${task.format}`);
  const held = takeData(task);
  // What the head sends is released (clipped and noised) when the task asks; the tail's
  // gradient goes back as it is (the web runtime refuses gradient noise).
  const parts = task.parts.map((part, i) => new DeviceStages(part, task.sgd,
                                                             i === 0 ? task.release : null));
  const [head, tail] = parts;
  const started = performance.now();
  let trunk: TrunkSocket | null = null;
  const tally = { steps: 0, examples: 0, loss_sum: 0, correct: 0, compute_s: 0, peak_bytes: 0 };
  try {
    trunk = await TrunkSocket.open(task.trunk.url, task.trunk.token, task.trunk.proof);
    view.set("round", String(task.round));
    view.set("batches", `0 / ${task.batches.length}`);
    (view.get("progress") as HTMLProgressElement).value = 0;
    for (const indices of task.batches) {
      const elapsed = (performance.now() - started) / 1000;
      const perBatch = tally.steps ? elapsed / tally.steps : 0;
      if (task.deadline_s !== null && tally.steps >= task.least_steps
          && elapsed + perBatch > task.deadline_s) break;
      const { inputs, labels } = batchOf(held, indices);
      const before = performance.now();
      const waited = trunk.waitS;
      const session = trunk;
      const train = () => (tail ? trainUShapedBatch(head, tail, session, inputs, labels)
        : trainBatch(head, session, inputs, labels));
      let outcome = { loss: 0, correct: 0 };
      if (tally.steps < MEASURED_BATCHES) { // the most TensorFlow.js held during the batch
        const info = await tf.profile(async () => { outcome = await train(); return []; });
        tally.peak_bytes = Math.max(tally.peak_bytes, info.peakBytes);
      } else {
        outcome = await train();
      }
      const { loss, correct } = outcome;
      const batchS = (performance.now() - before) / 1000 - (trunk.waitS - waited);
      tally.steps += 1;
      tally.examples += labels.length;
      tally.loss_sum += loss * labels.length;
      tally.correct += correct;
      tally.compute_s += batchS;
      progress(task, tally, batchS, trunk.bytesUp);
    }
    const states: State[] = parts.map((part) => part.state());
    // With its own pictures, how many classes they span (the ClientApp cannot count them).
    const classes = task.data.own ? { classes: new Set(held.labels).size } : {};
    return {
      states,
      metrics: { ...tally, wait_s: trunk.waitS, wall_s: (performance.now() - started) / 1000,
                 bytes_up: trunk.bytesUp, bytes_down: trunk.bytesDown, backend: tf.getBackend(),
                 ...classes },
    };
  } finally {
    trunk?.close();
    parts.forEach((part) => part.dispose());
  }
}

function progress(task: Task, tally: { steps: number; examples: number; loss_sum: number;
                  correct: number }, batchS: number, bytesUp: number): void {
  const share = tally.steps / Math.max(task.batches.length, 1);
  (view.get("progress") as HTMLProgressElement).value = share;
  view.set("batches", `${tally.steps} / ${task.batches.length}`);
  view.set("loss", (tally.loss_sum / tally.examples).toFixed(3));
  view.set("accuracy", `${(100 * tally.correct / tally.examples).toFixed(1)}%`);
  view.set("batch-ms", `${(1000 * batchS).toFixed(1)} ms`);
  view.set("sent", formatBytes(bytesUp));
  send({ progress: { steps: tally.steps, of: task.batches.length } });
}

async function onTask(task: Task): Promise<void> {
  busy = true;
  showState(`training round ${task.round}`);
  try {
    send({ result: await runTask(task) });
    showState(`round ${task.round} done; waiting for the next`);
  } catch (error) {
    const reason = error instanceof TrunkRefused ? `the trunk refused: ${error.message}`
      : String((error as Error).message ?? error);
    send({ failed: reason });
    showState(`round ${task.round} failed: ${reason}`);
  } finally {
    busy = false;
  }
}

function connect(): void {
  const stored = localStorage.getItem(DEVICE_KEY);
  const token = joinToken();
  if (!stored && !token) {
    showState("this page needs the join link the operator shared (it carries a token)");
    return;
  }
  showState("connecting");
  const socket = new WebSocket(gatewayUrl());
  gateway = socket;
  socket.onopen = () => {
    const hello = stored ? { rejoin: stored } : { join: token };
    socket.send(JSON.stringify({ ...hello, backend: tf.getBackend(), agent: navigator.userAgent }));
  };
  socket.onmessage = (event) => {
    const message = JSON.parse(String(event.data));
    if (message.joined) {
      localStorage.setItem(DEVICE_KEY, message.joined.device);
      view.set("node", `place ${message.joined.slot}, ` + (pictures
        ? `${pictures.length} own pictures` : `data share ${message.joined.partition}`));
      showState("connected; waiting for a round");
      const held = heldId();
      if (held) send({ holds: held });
    } else if (message.task) {
      if (busy) send({ failed: "this phone is still training the last round" });
      else void onTask(message.task as Task);
    } else if (message.status) {
      showState(String(message.status));
    }
  };
  socket.onclose = (event) => {
    if (gateway !== socket) return;
    gateway = null;
    if (leaving) {
      showState("you left; close this page");
      return;
    }
    if (event.code === 4401) { // the gateway turned this place away: start over
      localStorage.removeItem(DEVICE_KEY);
      showState(`not joined: ${event.reason}`);
      if (!stored) return;
    } else {
      showState(`disconnected (${event.reason || event.code}); retrying`);
    }
    setTimeout(connect, RETRY_MS);
  };
}

function leave(): void {
  leaving = true;
  send({ leave: true });
  localStorage.removeItem(DEVICE_KEY);
  gateway?.close(1000, "left");
  (view.get("leave") as HTMLButtonElement).disabled = true;
}

/** The pictures kept on this phone (an empty list if none, or unreadable). */
function keptPictures(): Picture[] {
  try {
    const kept = JSON.parse(localStorage.getItem(PICTURES_KEY) ?? "[]") as
      { label: number; size: number; rgba: string }[];
    return kept.map((p) => ({ label: p.label, size: p.size,
                              rgba: new Uint8ClampedArray(fromBase64(p.rgba)) }));
  } catch {
    return [];
  }
}

/** Keep the pictures for a reload; false if the browser's storage for the page is full. */
function keepPictures(chosen: Picture[]): boolean {
  try {
    localStorage.setItem(PICTURES_KEY, JSON.stringify(chosen.map((p) => (
      { label: p.label, size: p.size, rgba: toBase64(new Uint8Array(p.rgba.buffer)) }))));
    return true;
  } catch { // QuotaExceededError: about 900 pictures fit the usual 5 MB
    localStorage.removeItem(PICTURES_KEY);
    return false;
  }
}

/** "12 pictures: label 0 x3, label 1 x9" (no line break inside one label's count) */
function describePictures(chosen: Picture[]): string {
  if (!chosen.length) return "No pictures yet.";
  const counts = new Map<number, number>();
  chosen.forEach((p) => counts.set(p.label, (counts.get(p.label) ?? 0) + 1));
  const byLabel = [...counts].sort((a, b) => a[0] - b[0])
    .map(([l, n]) => `label\u00a0${l}\u00a0\u00d7${n}`);
  return `${chosen.length} picture${chosen.length === 1 ? "" : "s"}: ${byLabel.join(", ")}`;
}

/** The consent panel's choice of data: the assigned share, or the person's own pictures. */
function setUpPictures(): { ownChosen: () => boolean; chosen: () => Picture[] } {
  let chosen = keptPictures();
  const own = view.get("own-source") as HTMLInputElement;
  const panel = view.get("own");
  const show = () => {
    panel.hidden = !own.checked;
    view.set("own-count", describePictures(chosen));
  };
  document.querySelectorAll('input[name="source"]').forEach((radio) =>
    radio.addEventListener("change", show));
  view.get("pictures").addEventListener("change", async () => {
    const input = view.get("pictures") as HTMLInputElement;
    const label = Number((view.get("label") as HTMLInputElement).value);
    if (!(Number.isInteger(label) && label >= 0)) {
      view.set("own-count", "A label is a whole number from 0.");
      return;
    }
    const unread: string[] = [];
    for (const file of Array.from(input.files ?? [])) {
      if (chosen.length >= MAX_PICTURES) break;
      try {
        chosen.push(await readPicture(file, label));
      } catch { // not an image this browser decodes: left out, and said so below
        unread.push(file.name);
      }
    }
    input.value = "";
    const notes: string[] = []; // every one said at once: one would hide another
    if (chosen.length >= MAX_PICTURES) notes.push("the most a phone trains on");
    if (!keepPictures(chosen)) {
      notes.push("kept until this page closes: the browser's storage is full");
    }
    if (unread.length) notes.push(`not pictures: ${unread.join(", ")}`);
    show();
    if (notes.length) view.set("own-count", `${describePictures(chosen)} (${notes.join("; ")})`);
  });
  view.get("clear").addEventListener("click", () => {
    chosen = [];
    localStorage.removeItem(PICTURES_KEY);
    show();
  });
  own.checked = chosen.length > 0;
  show();
  return { ownChosen: () => own.checked, chosen: () => chosen };
}

async function start(): Promise<void> {
  view.set("backend", await startBackend(new URLSearchParams(location.search).get("backend")));
  const choice = setUpPictures();
  view.get("join").addEventListener("click", () => {
    if (!view.get("status").hidden) return; // joined already (a second click)
    if (choice.ownChosen()) {
      if (!choice.chosen().length) {
        view.set("own-count", "Add at least one picture, or train on the assigned examples.");
        return;
      }
      pictures = choice.chosen().slice();
    }
    view.get("consent").hidden = true;
    view.get("status").hidden = false;
    connect();
  });
  view.get("leave").addEventListener("click", leave);
  if (localStorage.getItem(DEVICE_KEY)) view.get("join").click(); // consented before
}

void start();
