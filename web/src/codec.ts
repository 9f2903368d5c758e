// Tensors cross the boundary as {shape, data}: data is the base64 of the float32
// values, little-endian, in row-major order of `shape` (PyTorch's layout: NCHW, OIHW).
// splitlearn/web.py writes and reads the same encoding.

export interface Encoded {
  shape: number[];
  data: string;
}

export function size(shape: number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

export function decode(encoded: Encoded): Float32Array {
  if (!encoded || !Array.isArray(encoded.shape) || typeof encoded.data !== "string") {
    throw new Error("splitlearn web runtime: a tensor must be {shape: number[], data: base64}");
  }
  const binary = atob(encoded.data);
  const expected = size(encoded.shape) * 4;
  if (binary.length !== expected) {
    throw new Error(`splitlearn web runtime: shape [${encoded.shape}] needs ${expected} bytes, ` +
      `got ${binary.length}`);
  }
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  const view = new DataView(bytes.buffer);
  const values = new Float32Array(binary.length / 4);
  for (let i = 0; i < values.length; i++) values[i] = view.getFloat32(i * 4, true);
  return values;
}

export function encode(shape: number[], values: Float32Array): Encoded {
  const bytes = new Uint8Array(values.length * 4);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < values.length; i++) view.setFloat32(i * 4, values[i], true);
  let binary = "";
  const chunk = 0x8000;
  for (let i = 0; i < bytes.length; i += chunk) {
    binary += String.fromCharCode.apply(null, Array.from(bytes.subarray(i, i + chunk)));
  }
  return { shape: shape.slice(), data: btoa(binary) };
}
