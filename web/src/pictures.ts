// A person's own pictures as training examples: each kept on the phone as a small square
// RGBA image with its label, turned into the run's input format when a task asks for it.
//
// The conversion is defined exactly, so that tests/integration/test_own_pictures.py can
// hold it to a NumPy reference: luma (ITU-R 601: 0.299 R + 0.587 G + 0.114 B) for a grey
// dataset, the picture averaged over each output pixel's area (the share of every source
// pixel it covers), values in [0, 1]. The grey datasets here (digits, MNIST, Fashion-MNIST)
// are light on a dark background; a photo of ink on paper is the other way round, so a
// grey picture whose border is lighter than mid-grey is inverted.

/** One picture: `size` x `size` RGBA bytes, row-major, and its label. */
export interface Picture {
  label: number;
  size: number;
  rgba: Uint8ClampedArray;
}

/** Largest side a picture is kept at (the datasets' images are at most 32 x 32). */
export const KEPT_SIZE = 32;

/** How much of source pixel `j` (of `from`) output pixel `i` (of `to`) covers, per axis. */
function areaWeights(from: number, to: number): Float64Array {
  const weights = new Float64Array(to * from);
  const scale = from / to;
  for (let i = 0; i < to; i++) {
    const start = i * scale;
    const end = (i + 1) * scale;
    for (let j = Math.floor(start); j < Math.min(Math.ceil(end), from); j++) {
      weights[i * from + j] = (Math.min(end, j + 1) - Math.max(start, j)) / scale;
    }
  }
  return weights;
}

/** The picture's channels (1: luma; 3: R, G, B) in [0, 1], `size` x `size` each. */
function planes(picture: Picture, channels: number): Float64Array[] {
  const n = picture.size * picture.size;
  const out = Array.from({ length: channels }, () => new Float64Array(n));
  for (let p = 0; p < n; p++) {
    const [r, g, b] = [picture.rgba[4 * p], picture.rgba[4 * p + 1], picture.rgba[4 * p + 2]];
    if (channels === 1) out[0][p] = (0.299 * r + 0.587 * g + 0.114 * b) / 255;
    else [r, g, b].forEach((value, c) => { out[c][p] = value / 255; });
  }
  return out;
}

/** Mean of a plane's outermost ring of pixels. */
function borderMean(plane: Float64Array, size: number): number {
  let sum = 0;
  let count = 0;
  for (let y = 0; y < size; y++) {
    for (let x = 0; x < size; x++) {
      if (y === 0 || x === 0 || y === size - 1 || x === size - 1) {
        sum += plane[y * size + x];
        count += 1;
      }
    }
  }
  return sum / count;
}

/**
 * One picture as the run's input: `channels` x `size` x `size` float32 values in [0, 1].
 *
 * @param lightOnDark The dataset's images are light on a dark background (invert a grey
 *   picture whose border is lighter than mid-grey).
 */
export function pictureValues(picture: Picture, channels: number, size: number,
                              lightOnDark: boolean): Float32Array {
  if (channels !== 1 && channels !== 3) throw new Error(`pictures have 1 or 3 channels, not ${channels}`);
  const weights = areaWeights(picture.size, size);
  const source = picture.size;
  const out = new Float32Array(channels * size * size);
  const rows = new Float64Array(size * source); // the plane averaged down its columns first
  planes(picture, channels).forEach((plane, c) => {
    const invert = channels === 1 && lightOnDark && borderMean(plane, source) > 0.5;
    rows.fill(0);
    for (let y = 0; y < size; y++) {
      for (let j = 0; j < source; j++) {
        const w = weights[y * source + j];
        if (w !== 0) for (let i = 0; i < source; i++) rows[y * source + i] += w * plane[j * source + i];
      }
    }
    for (let y = 0; y < size; y++) {
      for (let x = 0; x < size; x++) {
        let value = 0;
        for (let i = 0; i < source; i++) value += weights[x * source + i] * rows[y * source + i];
        out[(c * size + y) * size + x] = invert ? 1 - value : value;
      }
    }
  });
  return out;
}

/** Every picture as a row of the run's input, shape `[n, C, H, W]`, and the labels. */
export function picturesData(pictures: Picture[], shape: number[], lightOnDark: boolean,
                             classes: number): { rows: Float32Array; labels: number[] } {
  const [n, channels, height, width] = shape;
  if (n !== pictures.length || height !== width) {
    throw new Error(`the task asks for [${shape}]; this phone holds ${pictures.length} pictures`);
  }
  const sample = channels * height * width;
  const rows = new Float32Array(n * sample);
  pictures.forEach((picture, i) => {
    if (!(Number.isInteger(picture.label) && picture.label >= 0 && picture.label < classes)) {
      throw new Error(`label ${picture.label} is not a class of this study (0 to ${classes - 1})`);
    }
    rows.set(pictureValues(picture, channels, height, lightOnDark), i * sample);
  });
  return { rows, labels: pictures.map((p) => p.label) };
}

/**
 * A picture from a file the person chose: the largest centred square, reduced to
 * `KEPT_SIZE` (the browser's smoothing), as RGBA bytes.
 */
export async function readPicture(file: Blob, label: number): Promise<Picture> {
  const bitmap = await createImageBitmap(file);
  const side = Math.min(bitmap.width, bitmap.height);
  const size = Math.min(side, KEPT_SIZE);
  const canvas = document.createElement("canvas");
  canvas.width = size;
  canvas.height = size;
  const context = canvas.getContext("2d");
  if (!context) throw new Error("this browser cannot read pictures (no 2D canvas)");
  context.imageSmoothingQuality = "high";
  context.drawImage(bitmap, (bitmap.width - side) / 2, (bitmap.height - side) / 2, side, side,
                    0, 0, size, size);
  bitmap.close();
  return { label, size, rgba: context.getImageData(0, 0, size, size).data };
}

/** A short id of the pictures and their labels (FNV-1a, 32 bits): `own:<n>:<hex>`. */
export function picturesId(pictures: Picture[]): string {
  let hash = 0x811c9dc5;
  const mix = (byte: number) => { hash = Math.imul(hash ^ byte, 0x01000193) >>> 0; };
  for (const picture of pictures) {
    mix(picture.label & 0xff);
    mix(picture.size & 0xff);
    for (let i = 0; i < picture.rgba.length; i++) mix(picture.rgba[i]);
  }
  return `own:${pictures.length}:${hash.toString(16).padStart(8, "0")}`;
}
