// Bundles TensorFlow.js with web/src/index.ts into dist/device.js (it sets
// globalThis.splitlearnDevice, the runtime's API) and with web/src/page.ts into
// dist/page.js (the page a phone opens: web/public/index.html, served by the gateway).
// The wasm backend's binary is bundled as bytes (src/backends.ts says why).
import { build } from "esbuild";

await build({
  entryPoints: { device: "src/index.ts", page: "src/page.ts" },
  bundle: true,
  format: "iife",
  platform: "browser",
  target: "es2020",
  outdir: "dist",
  minify: true,
  sourcemap: false,
  loader: { ".wasm": "binary" },
  logLevel: "warning",
});
