// The bundle's entry: dist/device.js sets globalThis.splitlearnDevice.
import * as tf from "@tensorflow/tfjs";
import { setBackend } from "./backends";
import { encodeValues, valuesOf } from "./codec";
import {
  DeviceStages, FORMAT, Release, SgdOptions, StagesDescription, SUPPORTED,
} from "./stages";
import { pictureValues, picturesId } from "./pictures";
import { trainBatch, trainUShapedBatch } from "./steps";
import { TrunkRefused, TrunkSocket } from "./trunk";
import * as wire from "./wire";

function load(description: StagesDescription, sgd: SgdOptions,
              release: Release | null = null): DeviceStages {
  return new DeviceStages(description, sgd, release);
}

const api = {
  FORMAT,
  SUPPORTED,
  DeviceStages,
  load,
  values: valuesOf,
  encode: encodeValues,
  setBackend,
  connect: TrunkSocket.open,
  trainBatch,
  trainUShapedBatch,
  TrunkRefused,
  wire,
  /** A picture ({label, size, rgba}) as the run's input (web/src/pictures.ts). */
  pictureValues: (picture: { label: number; size: number; rgba: number[] }, channels: number,
                  size: number, lightOnDark: boolean) => Array.from(pictureValues(
    { ...picture, rgba: new Uint8ClampedArray(picture.rgba) }, channels, size, lightOnDark)),
  picturesId,
  backend: () => tf.getBackend(),
  version: () => tf.version.tfjs,
  tf,
};

(globalThis as unknown as { splitlearnDevice: typeof api }).splitlearnDevice = api;
