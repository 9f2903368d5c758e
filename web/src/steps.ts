// One training batch of each device step the web runtime runs, against the trunk.
import { Encoded, Values, valuesOf } from "./codec";
import { DeviceStages } from "./stages";
import { TrunkSocket } from "./trunk";

/**
 * One split step against the trunk: the stages' forward, the activations and labels to the
 * trunk, its gradient at the cut back through the stages, the SGD step.
 */
export async function trainBatch(stages: DeviceStages, trunk: TrunkSocket,
                                 inputs: Encoded | Values, labels: number[]
                                 ): Promise<{ loss: number; correct: number }> {
  const activations = stages.forwardValues(valuesOf(inputs), "train");
  const { grad, loss, correct } = await trunk.forward(activations, labels);
  stages.backward(grad);
  stages.step();
  return { loss, correct };
}

/**
 * One U-shaped step (SplitEasy's design: labels never leave the device): the head's
 * forward, the trunk's features back, the tail's forward, loss and backward, d loss /
 * d features to the trunk, its gradient at the cut back through the head; then both
 * SGD steps (one optimiser over head and tail, as the Python device has).
 */
export async function trainUShapedBatch(head: DeviceStages, tail: DeviceStages, trunk: TrunkSocket,
                                 inputs: Encoded | Values, labels: number[]
                                 ): Promise<{ loss: number; correct: number }> {
  const features = await trunk.forwardFeatures(head.forwardValues(valuesOf(inputs), "train"));
  tail.forwardValues(features, "train");
  const { loss, correct, inputGrad } = tail.lossBackward(labels);
  head.backward(await trunk.backward(inputGrad));
  head.step();
  tail.step();
  return { loss, correct };
}

