// The TensorFlow.js backends the runtime trains on, and which one a page starts with.
//
// `wasm` (XNNPACK kernels compiled to WebAssembly with SIMD) is the fast one on a CPU: the
// device step of the zoo's small networks runs several times faster than on `cpu` (plain
// JavaScript kernels); see benchmarks/web_step.py. Its binary is bundled (esbuild's binary
// loader) and handed to TensorFlow.js as a blob URL, so the bundle works wherever it is
// loaded, from the gateway or inlined into a test page, without serving a second file. Only
// the SIMD build is bundled (every current browser has WebAssembly SIMD); where it does not
// compile, `wasm` does not start and the page stays on another backend.
import * as tf from "@tensorflow/tfjs";
import { setWasmPaths } from "@tensorflow/tfjs-backend-wasm";
import simd from "@tensorflow/tfjs-backend-wasm/dist/tfjs-backend-wasm-simd.wasm";

/**
 * The order a page tries backends in when it is not asked for one: `wasm` first, as
 * TensorFlow.js advises for small models (its per-operation cost is far below WebGL's,
 * and every network a phone trains the bottom of here is small), then the phone's GPU.
 */
export const PREFERRED = ["wasm", "webgl", "cpu"] as const;

const url = URL.createObjectURL(new Blob([simd], { type: "application/wasm" }));
// TensorFlow.js picks the threaded build where the page is cross-origin isolated; it needs
// a worker script this bundle does not carry, so every name leads to the SIMD build (a
// page that is not isolated never asks for the threaded one).
setWasmPaths({
  "tfjs-backend-wasm.wasm": url,
  "tfjs-backend-wasm-simd.wasm": url,
  "tfjs-backend-wasm-threaded-simd.wasm": url,
});

/** Use the backend `name`; false if it does not initialise here (the previous one stays). */
export async function setBackend(name: string): Promise<boolean> {
  const before = tf.getBackend();
  let ok = false;
  try {
    ok = await tf.setBackend(name);
    await tf.ready();
  } catch {
    ok = false;
  }
  if (!ok && before && tf.getBackend() !== before) await tf.setBackend(before);
  return ok && tf.getBackend() === name;
}

/**
 * Start the page's backend: `asked` if it starts, else the first of `order` that does.
 *
 * @returns The backend in use.
 */
export async function startBackend(asked: string | null,
                                   order: readonly string[] = PREFERRED): Promise<string> {
  for (const name of asked ? [asked, ...order] : order) {
    if (await setBackend(name)) return name;
  }
  await tf.ready();
  return tf.getBackend();
}
