// A device's stages below the cut, as splitlearn/web.py describes them, trained as
// clients/steps/split.py trains them: forward, the gradient of the batch's mean loss at
// the cut from the trunk, backward, one torch.optim.SGD step.
//
// Layout: tensors enter and leave in PyTorch's layout (NCHW activations, OIHW conv
// weights); inside, 4-D activations are NHWC and conv weights HWIO (TensorFlow.js's).
// Flatten goes back to NCHW first, so its order is PyTorch's.

import * as tf from "@tensorflow/tfjs";
import { decode, Encoded, encodeValues, Values, valuesOf } from "./codec";

export const FORMAT = "splitlearn.web.stages/1";

/** One layer as splitlearn/web.py describes it (the fields each type reads are below). */
export interface LayerSpec {
  type: string;
  name: string;
  [field: string]: unknown;
}

export interface StagesDescription {
  format: string;
  input_shape: number[];
  output_shape: number[];
  layers: LayerSpec[];
  state: Record<string, Encoded>;
  counters?: Record<string, number>;
}

/** torch.optim.SGD's settings (dampening 0, nesterov false). */
export interface SgdOptions {
  lr: number;
  momentum?: number;
  weight_decay?: number;
}

/**
 * What the device releases instead of raw activations (privacy=activation_gaussian): each
 * row (example) scaled to an L2 norm of at most ``clip_norm``, plus Gaussian noise of
 * standard deviation ``noise_std`` (sigma x C) per value, drawn from crypto.getRandomValues.
 * The backward pass goes through the clipping (the noise is a constant), as in PyTorch.
 */
export interface Release {
  clip_norm: number;
  noise_std: number;
}

export interface State {
  tensors: Record<string, Encoded>;
  counters: Record<string, number>;
}

/** Added to each row's norm before dividing by it (as splitlearn/privacy/mechanism.py does). */
const NORM_EPS = 1e-6;

/** ``count`` independent N(0, std^2) values from the platform's cryptographic generator. */
export function gaussian(count: number, std: number): Float32Array {
  const out = new Float32Array(count);
  const uniform = new Uint32Array(2 * Math.ceil(count / 2));
  for (let i = 0; i < uniform.length; i += 16384) { // getRandomValues fills 64 KiB at most
    crypto.getRandomValues(uniform.subarray(i, Math.min(i + 16384, uniform.length)));
  }
  for (let i = 0; i < count; i += 2) { // Box-Muller: two uniforms in (0, 1], two normals
    const u1 = (uniform[i] + 1) / 4294967296;
    const u2 = (uniform[i + 1] + 1) / 4294967296;
    const r = std * Math.sqrt(-2 * Math.log(u1));
    out[i] = r * Math.cos(2 * Math.PI * u2);
    if (i + 1 < count) out[i + 1] = r * Math.sin(2 * Math.PI * u2);
  }
  return out;
}

/** The layer types this runtime runs; any other is refused by name. */
export const SUPPORTED = [
  "Conv2d", "BatchNorm2d", "ReLU", "ReLU6", "MaxPool2d", "AvgPool2d", "Flatten", "Linear",
  "Dropout", "Identity",
];

interface Pass {
  training: boolean;
  updateStats: boolean; // false when the backward pass recomputes the forward
  masks: Map<number, tf.Tensor>; // dropout masks, kept from the forward for the backward
}

interface Param {
  key: string; // PyTorch's state-dict key
  variable: tf.Variable;
  toTorch: number[] | null; // permutation back to PyTorch's layout
  trainable: boolean;
}

let nextModel = 0;

function pair(spec: LayerSpec, field: string): [number, number] {
  const value = spec[field];
  if (!Array.isArray(value) || value.length !== 2 || !value.every(Number.isInteger)) {
    throw new Error(`splitlearn web runtime: layer ${spec.name} (${spec.type}) needs ` +
      `${field} as two integers, got ${JSON.stringify(value)}`);
  }
  return [value[0] as number, value[1] as number];
}

function num(spec: LayerSpec, field: string): number {
  const value = spec[field];
  if (typeof value !== "number") {
    throw new Error(`splitlearn web runtime: layer ${spec.name} (${spec.type}) needs ` +
      `${field} as a number, got ${JSON.stringify(value)}`);
  }
  return value;
}

const NCHW_TO_NHWC = [0, 2, 3, 1];
const NHWC_TO_NCHW = [0, 3, 1, 2];
const OIHW_TO_HWIO = [2, 3, 1, 0];
const HWIO_TO_OIHW = [3, 2, 0, 1];

/**
 * tf.conv2d ("valid", NHWC, HWIO) with its filter's gradient computed as a forward
 * convolution: TensorFlow.js's cpu backend computes Conv2DBackpropFilter 15 times slower
 * than the convolution itself (1.26 s against 84 ms for SmallCNN's third conv, batch 8).
 * dW[i, j, c, o] = sum over n, h, w of x[n, h*sh + i, w*sw + j, c] * dy[n, h, w, o]: the
 * batch becomes the channels that are summed, and the stride the gradient's dilation.
 */
function conv2d(x: tf.Tensor4D, w: tf.Tensor4D, strides: [number, number]): tf.Tensor4D {
  // customGrad's typing takes (...inputs, save) as one list of Tensor | GradSaveFunc.
  const op = tf.customGrad(((...args: (tf.Tensor | tf.GradSaveFunc)[]) => {
    const [input, filter, save] = args as [tf.Tensor4D, tf.Tensor4D, tf.GradSaveFunc];
    save([input, filter]);
    return {
      value: tf.conv2d(input, filter, strides, "valid"),
      gradFunc: (dy: tf.Tensor4D, saved: tf.Tensor[]) => {
        const [xs, ws] = saved as [tf.Tensor4D, tf.Tensor4D];
        const [kh, kw, channels, out] = ws.shape;
        const dx = tf.conv2dTranspose(dy, ws, xs.shape, strides, "valid");
        const full = tf.conv2d(tf.transpose(xs, [3, 1, 2, 0]) as tf.Tensor4D,
          tf.transpose(dy, [1, 2, 0, 3]) as tf.Tensor4D, 1, "valid", "NHWC", strides);
        const dw = tf.transpose(tf.slice(full, [0, 0, 0, 0], [channels, kh, kw, out]),
          [1, 2, 0, 3]);
        return [dx, dw];
      },
    };
  }) as Parameters<typeof tf.customGrad>[0]);
  return op(x, w) as tf.Tensor4D;
}

/** The tensor ``make`` returns (in a tidy scope), as values, then disposed. */
function valuesFrom(make: () => tf.Tensor): Values {
  const tensor = tf.tidy(make);
  try {
    return { shape: tensor.shape.slice(), values: tensor.dataSync() as Float32Array };
  } finally {
    tensor.dispose();
  }
}

/** The tensor ``make`` returns, encoded for JSON. */
function encoded(make: () => tf.Tensor): Encoded {
  return encodeValues(valuesFrom(make));
}

export class DeviceStages {
  readonly layers: LayerSpec[];
  readonly inputShape: number[];
  private readonly params = new Map<string, Param>();
  private readonly counters = new Map<string, number>();
  private readonly momentum = new Map<string, tf.Tensor>();
  private readonly sgd: Required<SgdOptions>;
  private readonly prefix: string;
  private inputs: tf.Tensor | null = null;
  private masks = new Map<number, tf.Tensor>();
  private grads: Map<string, tf.Tensor> | null = null;
  private training = true; // the last forward's mode, which its backward recomputes
  private readonly release: Release | null;

  constructor(description: StagesDescription, sgd: SgdOptions, release: Release | null = null) {
    if (!description || description.format !== FORMAT) {
      throw new Error(`splitlearn web runtime: expected a description of format ${FORMAT}, ` +
        `got ${JSON.stringify(description && description.format)}`);
    }
    this.layers = description.layers;
    this.inputShape = description.input_shape;
    this.prefix = `splitlearn${nextModel++}/`;
    this.sgd = {
      lr: sgd.lr, momentum: sgd.momentum ?? 0, weight_decay: sgd.weight_decay ?? 0,
    };
    if (release && !(release.clip_norm > 0 && release.noise_std >= 0)) {
      throw new Error(`splitlearn web runtime: a release needs clip_norm > 0 and noise_std >= 0, ` +
        `got ${JSON.stringify(release)}`);
    }
    this.release = release;
    if (!(this.sgd.lr > 0) || this.sgd.momentum < 0 || this.sgd.weight_decay < 0) {
      throw new Error(`splitlearn web runtime: SGD needs lr > 0, momentum >= 0 and ` +
        `weight_decay >= 0, got ${JSON.stringify(sgd)}`);
    }
    this.layers.forEach((spec, index) => {
      if (!SUPPORTED.includes(spec.type)) {
        throw new Error(`splitlearn web runtime: unsupported layer type '${spec.type}' at ` +
          `layer ${index} (${spec.name}); it runs ${SUPPORTED.join(", ")}`);
      }
    });
    try {
      this.layers.forEach((spec) => this.loadLayer(spec, description));
    } catch (error) {
      this.dispose();
      throw error;
    }
  }

  private loadLayer(spec: LayerSpec, description: StagesDescription): void {
    const tensor = (field: string, trainable: boolean, perm: number[] | null = null) => {
      const key = `${spec.name}.${field}`;
      const encoded = description.state[key];
      if (!encoded) {
        throw new Error(`splitlearn web runtime: layer ${spec.name} (${spec.type}) has no ` +
          `${key} in the description's state`);
      }
      let value = tf.tensor(decode(encoded), encoded.shape, "float32");
      if (perm) {
        const moved = tf.transpose(value, perm);
        value.dispose();
        value = moved;
      }
      const variable = tf.variable(value, trainable, this.prefix + key, "float32");
      value.dispose();
      const back = perm === OIHW_TO_HWIO ? HWIO_TO_OIHW : null;
      this.params.set(key, { key, variable, toTorch: back, trainable });
    };
    switch (spec.type) {
      case "Conv2d":
        pair(spec, "kernel_size"); pair(spec, "stride"); pair(spec, "padding");
        tensor("weight", true, OIHW_TO_HWIO);
        if (spec.bias) tensor("bias", true);
        break;
      case "Linear":
        tensor("weight", true);
        if (spec.bias) tensor("bias", true);
        break;
      case "BatchNorm2d":
        num(spec, "eps");
        if (spec.affine) { tensor("weight", true); tensor("bias", true); }
        if (spec.track_running_stats) {
          tensor("running_mean", false);
          tensor("running_var", false);
          const key = `${spec.name}.num_batches_tracked`;
          this.counters.set(key, description.counters?.[key] ?? 0);
        }
        break;
      case "MaxPool2d":
      case "AvgPool2d":
        pair(spec, "kernel_size"); pair(spec, "stride"); pair(spec, "padding");
        break;
      case "Dropout":
        num(spec, "p");
        break;
      default:
        break;
    }
  }

  private param(spec: LayerSpec, field: string): tf.Variable {
    return (this.params.get(`${spec.name}.${field}`) as Param).variable;
  }

  /** The stages applied to `x` (NCHW in, PyTorch's layout out). */
  private run(x: tf.Tensor, pass: Pass): tf.Tensor {
    let h = x.rank === 4 ? tf.transpose(x, NCHW_TO_NHWC) : x;
    this.layers.forEach((spec, index) => {
      h = this.apply(spec, index, h, pass);
    });
    return h.rank === 4 ? tf.transpose(h, NHWC_TO_NCHW) : h;
  }

  private apply(spec: LayerSpec, index: number, h: tf.Tensor, pass: Pass): tf.Tensor {
    switch (spec.type) {
      case "Conv2d": {
        const [sh, sw] = pair(spec, "stride");
        const [ph, pw] = pair(spec, "padding");
        let x = h as tf.Tensor4D;
        if (ph || pw) x = tf.pad(x, [[0, 0], [ph, ph], [pw, pw], [0, 0]]);
        let y: tf.Tensor = conv2d(x, this.param(spec, "weight") as tf.Tensor4D, [sh, sw]);
        if (spec.bias) y = tf.add(y, this.param(spec, "bias"));
        return y;
      }
      case "Linear": {
        let y: tf.Tensor = tf.matMul(h as tf.Tensor2D, this.param(spec, "weight") as tf.Tensor2D,
          false, true);
        if (spec.bias) y = tf.add(y, this.param(spec, "bias"));
        return y;
      }
      case "BatchNorm2d":
        return this.batchNorm(spec, h, pass);
      case "ReLU":
        return tf.relu(h);
      case "ReLU6":
        return tf.relu6(h);
      case "MaxPool2d":
      case "AvgPool2d": {
        const kernel = pair(spec, "kernel_size");
        const stride = pair(spec, "stride");
        const [ph, pw] = pair(spec, "padding");
        if (ph !== pw || (spec.type === "AvgPool2d" && ph !== 0)) {
          throw new Error(`splitlearn web runtime: layer ${spec.name} (${spec.type}) pads ` +
            `[${ph}, ${pw}]; it runs max pools with equal padding, average pools without`);
        }
        const x = h as tf.Tensor4D;
        return spec.type === "MaxPool2d"
          ? tf.maxPool(x, kernel, stride, ph === 0 ? "valid" : ph)
          : tf.avgPool(x, kernel, stride, "valid");
      }
      case "Flatten": {
        const x = h.rank === 4 ? tf.transpose(h, NHWC_TO_NCHW) : h;
        return tf.reshape(x, [x.shape[0], -1]);
      }
      case "Dropout": {
        const p = num(spec, "p");
        if (!pass.training || p === 0) return h;
        if (p >= 1) return tf.zerosLike(h);
        let mask = pass.masks.get(index);
        if (!mask) {
          // torch's scaling: kept values are divided by 1 - p.
          mask = tf.keep(tf.div(tf.cast(tf.greaterEqual(tf.randomUniform(h.shape), p),
            "float32"), 1 - p));
          pass.masks.set(index, mask);
        }
        return tf.mul(h, mask);
      }
      case "Identity":
        return h;
      default:
        throw new Error(`splitlearn web runtime: unsupported layer type '${spec.type}' at ` +
          `layer ${index} (${spec.name})`);
    }
  }

  /** torch.nn.BatchNorm2d (NHWC here): batch statistics in training, running ones else. */
  private batchNorm(spec: LayerSpec, h: tf.Tensor, pass: Pass): tf.Tensor {
    const eps = num(spec, "eps");
    const tracks = Boolean(spec.track_running_stats);
    let mean: tf.Tensor;
    let variance: tf.Tensor;
    if (pass.training || !tracks) {
      mean = tf.mean(h, [0, 1, 2]);
      const centred = tf.sub(h, mean);
      variance = tf.mean(tf.square(centred), [0, 1, 2]); // biased, as torch normalises
      if (pass.training && tracks && pass.updateStats) {
        const counter = `${spec.name}.num_batches_tracked`;
        const count = (this.counters.get(counter) ?? 0) + 1;
        this.counters.set(counter, count);
        const momentum = spec.momentum === null ? 1 / count : num(spec, "momentum");
        const n = h.size / h.shape[3]!;
        const unbiased = tf.mul(variance, n / Math.max(n - 1, 1));
        const runningMean = this.param(spec, "running_mean");
        const runningVar = this.param(spec, "running_var");
        tf.tidy(() => {
          runningMean.assign(tf.add(tf.mul(runningMean, 1 - momentum),
            tf.mul(mean, momentum)));
          runningVar.assign(tf.add(tf.mul(runningVar, 1 - momentum),
            tf.mul(unbiased, momentum)));
        });
      }
    } else {
      mean = this.param(spec, "running_mean");
      variance = this.param(spec, "running_var");
    }
    let y = tf.mul(tf.sub(h, mean), tf.rsqrt(tf.add(variance, eps)));
    if (spec.affine) y = tf.add(tf.mul(y, this.param(spec, "weight")), this.param(spec, "bias"));
    return y;
  }

  private trainables(): Param[] {
    return [...this.params.values()].filter((p) => p.trainable);
  }

  private toTorch(param: Param, value: tf.Tensor): Encoded {
    return encoded(() => (param.toTorch ? tf.transpose(value, param.toTorch) : tf.clone(value)));
  }

  private check(shape: number[], what: string): void {
    const expected = this.inputShape;
    if (shape.length !== expected.length + 1 ||
        expected.some((d, i) => d !== shape[i + 1])) {
      throw new Error(`splitlearn web runtime: ${what} of shape [${shape}], expected ` +
        `[batch, ${expected}]`);
    }
  }

  /** forwardValues for JSON: the batch and the activations base64-encoded. */
  forward(inputs: Encoded | Values, mode: "train" | "eval" = "train"): Encoded {
    return encodeValues(this.forwardValues(valuesOf(inputs), mode));
  }

  /**
   * Run the stages on a batch (NCHW) as torch does in `mode` ("train": batch statistics,
   * running statistics updated, dropout on; "eval": neither), and keep the batch for the
   * backward pass. Returns the activations at the cut, in PyTorch's layout.
   */
  forwardValues(inputs: Values, mode: "train" | "eval" = "train"): Values {
    this.check(inputs.shape, "inputs");
    this.inputs?.dispose();
    this.masks.forEach((m) => m.dispose());
    this.masks = new Map();
    this.grads?.forEach((g) => g.dispose());
    this.grads = null;
    this.inputs = tf.keep(tf.tensor(inputs.values, inputs.shape, "float32"));
    this.training = mode === "train";
    const pass: Pass = { training: this.training, updateStats: true, masks: this.masks };
    return valuesFrom(() => {
      const out = this.clipped(this.run(this.inputs as tf.Tensor, pass));
      if (!this.release || this.release.noise_std === 0) return out;
      return tf.add(out, tf.tensor(gaussian(out.size, this.release.noise_std), out.shape));
    });
  }

  /** Each row of ``out`` scaled to an L2 norm of at most the release's clip (as is without). */
  private clipped(out: tf.Tensor): tf.Tensor {
    if (!this.release) return out;
    const axes = out.shape.map((_, i) => i).slice(1);
    const norms = tf.sqrt(tf.sum(tf.square(out), axes));
    const factor = tf.minimum(1, tf.div(this.release.clip_norm, tf.add(norms, NORM_EPS)));
    return tf.mul(out, tf.reshape(factor, [out.shape[0], ...axes.map(() => 1)]));
  }

  /**
   * backward, then every parameter's gradient in PyTorch's layout, encoded by state-dict
   * key (what a test compares with torch; training needs only backward).
   */
  backwardFromCutGradient(grad: Encoded | Values): Record<string, Encoded> {
    this.backward(valuesOf(grad));
    const result: Record<string, Encoded> = {};
    for (const p of this.trainables()) result[p.key] = this.toTorch(p, this.grads?.get(p.key) as tf.Tensor);
    return result;
  }

  /**
   * The gradient of every parameter, from the gradient at the cut of the last forward's
   * output (PyTorch's layout), as torch.autograd.backward(output, grad) gives it, kept for
   * step(). The forward is recomputed (same batch, same dropout masks, running statistics
   * left).
   */
  backward(grad: Values): void {
    if (!this.inputs) throw new Error("splitlearn web runtime: backward before forward");
    const inputs = this.inputs;
    const dy = tf.tensor(grad.values, grad.shape, "float32");
    const pass: Pass = { training: this.training, updateStats: false, masks: this.masks };
    const trainables = this.trainables();
    try {
      const { value, grads } = tf.variableGrads(() => {
        const out = this.clipped(this.run(inputs, pass));
        if (out.shape.length !== dy.shape.length || out.shape.some((d, i) => d !== dy.shape[i])) {
          throw new Error(`splitlearn web runtime: cut gradient of shape [${dy.shape}], ` +
            `the output is [${out.shape}]`);
        }
        return tf.sum(tf.mul(out, dy)) as tf.Scalar;
      }, trainables.map((p) => p.variable));
      value.dispose();
      this.grads?.forEach((g) => g.dispose());
      this.grads = new Map(trainables.map((p) => [p.key, grads[p.variable.name]]));
    } finally {
      dy.dispose();
    }
  }

  /**
   * A U-shaped tail's part: the mean cross-entropy of the last forward's output (logits)
   * against ``labels``, as nn.functional.cross_entropy gives it; every parameter's gradient
   * of that loss (kept for step()) and its gradient with respect to the forward's inputs,
   * in PyTorch's layout (what the device returns to the trunk). The forward is recomputed,
   * as in backward.
   */
  lossBackward(labels: ArrayLike<number>): { loss: number; correct: number; inputGrad: Values } {
    if (!this.inputs) throw new Error("splitlearn web runtime: backward before forward");
    const pass: Pass = { training: this.training, updateStats: false, masks: this.masks };
    const trainables = this.trainables();
    const x = tf.variable(this.inputs, true); // the inputs as a variable: their gradient too
    const y = tf.tensor1d(Array.from(labels), "int32");
    const kept: { predicted: tf.Tensor | null } = { predicted: null };
    try {
      const { value, grads } = tf.variableGrads(() => {
        const logits = this.run(x, pass);
        if (logits.rank !== 2 || logits.shape[0] !== y.shape[0]) {
          throw new Error(`splitlearn web runtime: the loss needs logits [batch, classes] for ` +
            `${y.shape[0]} labels, the stages give [${logits.shape}]`);
        }
        kept.predicted = tf.keep(tf.argMax(logits, 1));
        const onehot = tf.oneHot(y, logits.shape[1] as number);
        return tf.neg(tf.mean(tf.sum(tf.mul(onehot, tf.logSoftmax(logits)), 1))) as tf.Scalar;
      }, [...trainables.map((p) => p.variable), x]);
      const loss = value.dataSync()[0];
      const hits = tf.tidy(() => tf.sum(tf.equal(kept.predicted as tf.Tensor, y)));
      const correct = hits.dataSync()[0];
      hits.dispose();
      value.dispose();
      this.grads?.forEach((g) => g.dispose());
      this.grads = new Map(trainables.map((p) => [p.key, grads[p.variable.name]]));
      const dx = grads[x.name];
      const inputGrad = { shape: dx.shape.slice(), values: dx.dataSync() as Float32Array };
      dx.dispose();
      return { loss, correct, inputGrad };
    } finally {
      x.dispose();
      y.dispose();
      kept.predicted?.dispose();
    }
  }

  /**
   * One torch.optim.SGD step with the last backward's gradients: weight decay added to the
   * gradient, momentum buffer b = momentum * b + g (b = g on the first step), p -= lr * b.
   */
  step(): void {
    if (!this.grads) throw new Error("splitlearn web runtime: step before backward");
    const { lr, momentum, weight_decay: decay } = this.sgd;
    for (const p of this.trainables()) {
      const g = this.grads.get(p.key) as tf.Tensor;
      tf.tidy(() => {
        let d = decay !== 0 ? tf.add(g, tf.mul(p.variable, decay)) : g;
        if (momentum !== 0) {
          const previous = this.momentum.get(p.key);
          const buffer = tf.keep(previous ? tf.add(tf.mul(previous, momentum), d) : tf.clone(d));
          previous?.dispose();
          this.momentum.set(p.key, buffer);
          d = buffer;
        }
        p.variable.assign(tf.sub(p.variable, tf.mul(d, lr)));
      });
    }
    this.grads.forEach((g) => g.dispose());
    this.grads = null;
  }

  /** One split step: forward, backward from the cut gradient, SGD step. */
  trainStep(inputs: Encoded | Values, grad: Encoded | Values): Encoded {
    const out = this.forward(inputs, "train");
    this.backward(valuesOf(grad));
    this.step();
    return out;
  }

  /** The dropout masks of the last forward (PyTorch's layout, scaled by 1 / (1 - p)). */
  dropoutMasks(): Record<string, Encoded> {
    const result: Record<string, Encoded> = {};
    this.masks.forEach((mask, index) => {
      result[this.layers[index].name] = encoded(
        () => (mask.rank === 4 ? tf.transpose(mask, NHWC_TO_NCHW) : tf.clone(mask)));
    });
    return result;
  }

  /** Parameters and buffers under their state-dict keys, in PyTorch's layout. */
  state(): State {
    const tensors: Record<string, Encoded> = {};
    this.params.forEach((p) => { tensors[p.key] = this.toTorch(p, p.variable); });
    return { tensors, counters: Object.fromEntries(this.counters) };
  }

  dispose(): void {
    this.params.forEach((p) => p.variable.dispose());
    this.params.clear();
    this.momentum.forEach((b) => b.dispose());
    this.momentum.clear();
    this.masks.forEach((m) => m.dispose());
    this.masks.clear();
    this.grads?.forEach((g) => g.dispose());
    this.grads = null;
    this.inputs?.dispose();
    this.inputs = null;
  }
}
