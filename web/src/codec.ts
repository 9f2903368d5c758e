// Tensors cross the boundary as {shape, data}: data is the base64 of the float32
// values, little-endian, in row-major order of `shape` (PyTorch's layout: NCHW, OIHW).
// splitlearn/web.py writes and reads the same encoding. That is for JSON (the task, a test
// driving the page); a training batch stays {shape, values} from the data to the frame.

export interface Encoded {
  shape: number[];
  data: string;
}

/** A tensor's float32 values in row-major order of ``shape`` (PyTorch's layout). */
export interface Values {
  shape: number[];
  values: Float32Array;
}

export function size(shape: number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

/** Whether this host stores a float32 little-endian (then its bytes are the wire's as they are). */
const LITTLE_ENDIAN = new Uint8Array(new Float32Array([1]).buffer)[3] === 0x3f;

/** The bytes of a base64 string. */
export function fromBase64(text: string): Uint8Array {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

/** A base64 string of ``bytes`` (String.fromCharCode takes the typed array as it is). */
export function toBase64(bytes: Uint8Array): string {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000) as unknown as number[]);
  }
  return btoa(binary);
}

/** Little-endian float32 bytes as values (a view's copy where the host is little-endian). */
export function float32FromBytes(bytes: Uint8Array): Float32Array {
  if (LITTLE_ENDIAN) return new Float32Array(bytes.slice().buffer);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const values = new Float32Array(bytes.length / 4);
  for (let i = 0; i < values.length; i++) values[i] = view.getFloat32(i * 4, true);
  return values;
}

/** Values as little-endian float32 bytes (a view of them where the host is little-endian). */
export function bytesOfFloat32(values: Float32Array): Uint8Array {
  if (LITTLE_ENDIAN) return new Uint8Array(values.buffer, values.byteOffset, values.byteLength);
  const bytes = new Uint8Array(values.length * 4);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < values.length; i++) view.setFloat32(i * 4, values[i], true);
  return bytes;
}

export function decode(encoded: Encoded): Float32Array {
  if (!encoded || !Array.isArray(encoded.shape) || typeof encoded.data !== "string") {
    throw new Error("splitlearn web runtime: a tensor must be {shape: number[], data: base64}");
  }
  const bytes = fromBase64(encoded.data);
  const expected = size(encoded.shape) * 4;
  if (bytes.length !== expected) {
    throw new Error(`splitlearn web runtime: shape [${encoded.shape}] needs ${expected} bytes, ` +
      `got ${bytes.length}`);
  }
  return float32FromBytes(bytes);
}

export function encode(shape: number[], values: Float32Array): Encoded {
  return { shape: shape.slice(), data: toBase64(bytesOfFloat32(values)) };
}

/** ``tensor`` as values: decoded once where it is base64, checked against its shape. */
export function valuesOf(tensor: Encoded | Values): Values {
  if (tensor && (tensor as Values).values instanceof Float32Array) {
    const given = tensor as Values;
    if (given.values.length !== size(given.shape)) {
      throw new Error(`splitlearn web runtime: shape [${given.shape}] needs ${size(given.shape)} ` +
        `values, got ${given.values.length}`);
    }
    return given;
  }
  const encoded = tensor as Encoded;
  return { shape: encoded.shape.slice(), values: decode(encoded) };
}

/** ``values`` encoded for JSON. */
export function encodeValues(tensor: Values): Encoded {
  return encode(tensor.shape, tensor.values);
}
