// The bundle's entry: dist/device.js sets globalThis.splitlearnDevice.
import * as tf from "@tensorflow/tfjs";
import { Encoded } from "./codec";
import { DeviceStages, FORMAT, SgdOptions, StagesDescription, SUPPORTED } from "./stages";
import { TrunkRefused, TrunkSocket } from "./trunk";
import * as wire from "./wire";

/** Use a TensorFlow.js backend ("cpu", "webgl"); false if it does not initialise here. */
async function setBackend(name: string): Promise<boolean> {
  let ok = false;
  try {
    ok = await tf.setBackend(name);
    await tf.ready();
  } catch {
    ok = false;
  }
  return ok && tf.getBackend() === name;
}

function load(description: StagesDescription, sgd: SgdOptions): DeviceStages {
  return new DeviceStages(description, sgd);
}

/**
 * One split step against the trunk: the stages' forward, the activations and labels to the
 * trunk, its gradient at the cut back through the stages, the SGD step.
 */
async function trainBatch(stages: DeviceStages, trunk: TrunkSocket, inputs: Encoded,
                          labels: number[]): Promise<{ loss: number; correct: number }> {
  const activations = stages.forward(inputs, "train");
  const { grad, loss, correct } = await trunk.forward(activations, labels);
  stages.backwardFromCutGradient(grad);
  stages.step();
  return { loss, correct };
}

/**
 * One U-shaped step (SplitEasy's design: labels never leave the device): the head's
 * forward, the trunk's features back, the tail's forward, loss and backward, d loss /
 * d features to the trunk, its gradient at the cut back through the head; then both
 * SGD steps (one optimiser over head and tail, as the Python device has).
 */
async function trainUShapedBatch(head: DeviceStages, tail: DeviceStages, trunk: TrunkSocket,
                                 inputs: Encoded, labels: number[]
                                 ): Promise<{ loss: number; correct: number }> {
  const features = await trunk.forwardFeatures(head.forward(inputs, "train"));
  tail.forward(features, "train");
  const { loss, correct, inputGrad } = tail.lossBackward(labels);
  head.backwardFromCutGradient(await trunk.backward(inputGrad));
  head.step();
  tail.step();
  return { loss, correct };
}

const api = {
  FORMAT,
  SUPPORTED,
  DeviceStages,
  load,
  setBackend,
  connect: TrunkSocket.open,
  trainBatch,
  trainUShapedBatch,
  TrunkRefused,
  wire,
  backend: () => tf.getBackend(),
  version: () => tf.version.tfjs,
  tf,
};

(globalThis as unknown as { splitlearnDevice: typeof api }).splitlearnDevice = api;
