// trunk.proto's messages, as far as a web device sends and reads them, in protobuf's wire
// format (https://protobuf.dev/programming-guides/encoding/). Written out rather than
// generated: a device needs four requests and five replies, and a generated module would
// pull a protobuf runtime into every phone's download. The field numbers are the .proto's;
// tests/integration/test_web_trunk.py checks these bytes against Python's own protobuf.

import { bytesOfFloat32, float32FromBytes } from "./codec";

export const enum DType {
  FLOAT32 = 1,
  FLOAT16 = 2,
  BFLOAT16 = 3,
  INT64 = 4,
  INT8 = 5,
}

/** The refusal reasons of trunk.proto's Refusal.Reason, by number. */
export const REASONS = [
  "REASON_UNSPECIFIED", "MALFORMED", "TOO_LARGE", "TOKEN_REJECTED", "UNEXPECTED_KIND",
  "BAD_TENSOR", "NOT_FINITE", "OUT_OF_RANGE", "REPLAYED", "NO_PENDING_FORWARD",
  "STEP_NOT_FINITE", "BUSY", "INTERNAL", "STALE_FEEDBACK", "QUARANTINED",
];

export interface Tensor {
  dtype: number;
  shape: number[];
  data: Uint8Array;
}

// --- writing ---------------------------------------------------------------------------

class Writer {
  private parts: Uint8Array[] = [];
  private length = 0;

  private push(bytes: Uint8Array): void {
    this.parts.push(bytes);
    this.length += bytes.length;
  }

  varint(value: number): void {
    if (!Number.isSafeInteger(value) || value < 0) {
      throw new Error(`splitlearn wire: ${value} is not a non-negative safe integer`);
    }
    const out: number[] = [];
    let v = value;
    while (v >= 0x80) {
      out.push((v % 0x80) | 0x80);
      v = Math.floor(v / 0x80);
    }
    out.push(v);
    this.push(Uint8Array.from(out));
  }

  tag(field: number, wireType: number): void {
    this.varint(field * 8 + wireType);
  }

  uint(field: number, value: number): void {
    if (value === 0) return; // proto3: a default is not written
    this.tag(field, 0);
    this.varint(value);
  }

  bytes(field: number, value: Uint8Array): void {
    this.tag(field, 2);
    this.varint(value.length);
    this.push(value);
  }

  message(field: number, inner: Writer): void {
    this.bytes(field, inner.finish());
  }

  finish(): Uint8Array {
    const out = new Uint8Array(this.length);
    let at = 0;
    for (const part of this.parts) {
      out.set(part, at);
      at += part.length;
    }
    return out;
  }
}

function tensorWriter(tensor: Tensor): Writer {
  const w = new Writer();
  w.uint(1, tensor.dtype);
  if (tensor.shape.length) {
    const shape = new Writer(); // packed repeated uint64
    for (const d of tensor.shape) shape.varint(d);
    w.bytes(2, shape.finish());
  }
  if (tensor.data.length) w.bytes(3, tensor.data);
  return w;
}

/** float32 values, little-endian, as a FLOAT32 tensor of ``shape``. */
export function float32Tensor(shape: number[], values: Float32Array): Tensor {
  return { dtype: DType.FLOAT32, shape, data: bytesOfFloat32(values) };
}

/** Integer labels as an INT64 tensor (one row each). */
export function int64Tensor(values: ArrayLike<number>): Tensor {
  const data = new Uint8Array(values.length * 8);
  const view = new DataView(data.buffer);
  for (let i = 0; i < values.length; i++) view.setBigInt64(i * 8, BigInt(values[i]), true);
  return { dtype: DType.INT64, shape: [values.length], data };
}

/** Request{seq, forward: {activations, labels?}}; ``kind`` "evaluate" for Evaluate. */
export function forwardRequest(seq: number, activations: Tensor, labels: Tensor | null,
                               kind: "forward" | "evaluate" = "forward"): Uint8Array {
  const part = new Writer();
  part.message(1, tensorWriter(activations));
  if (labels !== null) part.message(2, tensorWriter(labels));
  const w = new Writer();
  w.uint(1, seq);
  w.message(kind === "forward" ? 2 : 3, part);
  return w.finish();
}

/** Request{seq, backward: {grad}} (U-shaped: d loss / d features). */
export function backwardRequest(seq: number, grad: Tensor): Uint8Array {
  const part = new Writer();
  part.message(1, tensorWriter(grad));
  const w = new Writer();
  w.uint(1, seq);
  w.message(4, part);
  return w.finish();
}

// --- reading ---------------------------------------------------------------------------

class Reader {
  at = 0;

  constructor(private readonly bytes: Uint8Array) {}

  done(): boolean {
    return this.at >= this.bytes.length;
  }

  varint(): number {
    let value = 0;
    let scale = 1;
    for (let i = 0; i < 10; i++) {
      if (this.at >= this.bytes.length) throw new Error("splitlearn wire: truncated varint");
      const byte = this.bytes[this.at++];
      value += (byte & 0x7f) * scale;
      if (!(byte & 0x80)) return value;
      scale *= 0x80;
    }
    throw new Error("splitlearn wire: a varint longer than 10 bytes");
  }

  field(): [number, number] {
    const key = this.varint();
    return [Math.floor(key / 8), key % 8];
  }

  slice(): Uint8Array {
    const length = this.varint();
    if (this.at + length > this.bytes.length) throw new Error("splitlearn wire: truncated field");
    const out = this.bytes.subarray(this.at, this.at + length);
    this.at += length;
    return out;
  }

  double(): number {
    if (this.at + 8 > this.bytes.length) throw new Error("splitlearn wire: truncated double");
    const view = new DataView(this.bytes.buffer, this.bytes.byteOffset + this.at, 8);
    this.at += 8;
    return view.getFloat64(0, true);
  }

  skip(wireType: number): void {
    if (wireType === 0) this.varint();
    else if (wireType === 1) this.at += 8;
    else if (wireType === 2) this.slice();
    else if (wireType === 5) this.at += 4;
    else throw new Error(`splitlearn wire: unknown wire type ${wireType}`);
  }
}

function readTensor(bytes: Uint8Array): Tensor {
  const r = new Reader(bytes);
  const tensor: Tensor = { dtype: 0, shape: [], data: new Uint8Array(0) };
  while (!r.done()) {
    const [field, type] = r.field();
    if (field === 1 && type === 0) tensor.dtype = r.varint();
    else if (field === 2 && type === 2) {
      const packed = new Reader(r.slice());
      while (!packed.done()) tensor.shape.push(packed.varint());
    } else if (field === 2 && type === 0) tensor.shape.push(r.varint());
    else if (field === 3 && type === 2) tensor.data = r.slice();
    else if (field >= 4 && field <= 7) {
      throw new Error("splitlearn wire: a compressed tensor (scales, indices or mask); the web " +
        "runtime reads dense float32: run with dataplane.compression.downlink=none");
    } else r.skip(type);
  }
  return tensor;
}

/** A dense FLOAT32 tensor's values. */
/** Refuse a tensor that is not dense float32 of its shape's length. */
export function checkFloat32(tensor: Tensor): void {
  if (tensor.dtype !== DType.FLOAT32) {
    throw new Error(`splitlearn wire: dtype ${tensor.dtype} where float32 was expected ` +
      "(the web runtime reads dense float32: dataplane.compression.downlink=none)");
  }
  const count = tensor.shape.reduce((a, b) => a * b, 1);
  if (tensor.data.length !== count * 4) {
    throw new Error(`splitlearn wire: shape [${tensor.shape}] needs ${count * 4} bytes, got ` +
      `${tensor.data.length}`);
  }
}

export function float32Values(tensor: Tensor): Float32Array {
  checkFloat32(tensor);
  return float32FromBytes(tensor.data);
}

export interface Reply {
  seq: number;
  kind: "gradient" | "metrics" | "features" | "ack" | "refusal" | "";
  tensor?: Tensor; // gradient.grad or features.features
  loss?: number;
  correct?: number;
  reason?: string;
  detail?: string;
}

const REPLY_KINDS: Record<number, Reply["kind"]> = {
  2: "gradient", 3: "metrics", 4: "features", 5: "ack", 6: "refusal",
};

function readPart(kind: Reply["kind"], bytes: Uint8Array, reply: Reply): void {
  const r = new Reader(bytes);
  while (!r.done()) {
    const [field, type] = r.field();
    if (kind === "refusal" && field === 1 && type === 0) reply.reason = REASONS[r.varint()] ?? "";
    else if (kind === "refusal" && field === 2 && type === 2) {
      reply.detail = new TextDecoder().decode(r.slice());
    } else if ((kind === "gradient" || kind === "features") && field === 1 && type === 2) {
      reply.tensor = readTensor(r.slice());
    } else if ((kind === "gradient" && field === 2) || (kind === "metrics" && field === 1)) {
      reply.loss = type === 1 ? r.double() : (r.skip(type), undefined);
    } else if ((kind === "gradient" && field === 3) || (kind === "metrics" && field === 2)) {
      reply.correct = type === 0 ? r.varint() : (r.skip(type), undefined);
    } else r.skip(type);
  }
}

/** Decode a Reply frame. */
export function readReply(bytes: Uint8Array): Reply {
  const r = new Reader(bytes);
  const reply: Reply = { seq: 0, kind: "" };
  while (!r.done()) {
    const [field, type] = r.field();
    if (field === 1 && type === 0) reply.seq = r.varint();
    else if (REPLY_KINDS[field] !== undefined && type === 2) {
      reply.kind = REPLY_KINDS[field];
      readPart(reply.kind, r.slice(), reply);
    } else r.skip(type);
  }
  return reply;
}
