// Bundles web/src/index.ts and TensorFlow.js into dist/device.js, one script for a
// browser page: it sets globalThis.splitlearnDevice (web/src/index.ts).
import { build } from "esbuild";

await build({
  entryPoints: ["src/index.ts"],
  bundle: true,
  format: "iife",
  platform: "browser",
  target: "es2020",
  outfile: "dist/device.js",
  minify: true,
  sourcemap: false,
  logLevel: "warning",
});
