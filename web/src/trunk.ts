// A web device's session with the trunk: the WebSocket service of
// splitlearn/dataplane/websocket.py, the same trunk.proto frames as the gRPC stream.
import { Values } from "./codec";
import {
  backwardRequest, float32Tensor, float32Values, forwardRequest, int64Tensor, readReply, Reply,
  Tensor,
} from "./wire";

/** The trunk refused a frame (nothing changed there); ``reason`` is trunk.proto's name. */
export class TrunkRefused extends Error {
  constructor(readonly reason: string, readonly detail: string) {
    super(`${reason}: ${detail}`);
  }
}

/** A FLOAT32 tensor's values (checked against its shape), in the runtime's form. */
export function valuesOfTensor(tensor: Tensor): Values {
  return { shape: tensor.shape.slice(), values: float32Values(tensor) };
}

function tensorOf(tensor: Values): Tensor {
  return float32Tensor(tensor.shape, tensor.values);
}

/** The reply's tensor, when it is of ``kind``; a refusal throws TrunkRefused. */
function expect(reply: Reply, kind: Reply["kind"]): Tensor {
  if (reply.kind === "refusal") throw new TrunkRefused(reply.reason ?? "", reply.detail ?? "");
  if (reply.kind !== kind || !reply.tensor) {
    throw new Error(`splitlearn trunk: a '${reply.kind}' reply where '${kind}' belongs`);
  }
  return reply.tensor;
}

type Waiter = { resolve: (reply: Uint8Array) => void; reject: (err: Error) => void };

export class TrunkSocket {
  bytesUp = 0;
  bytesDown = 0;
  /** Seconds spent waiting for the trunk's replies (the trunk's time, not the device's). */
  waitS = 0;
  private seq = 0;
  private waiter: Waiter | null = null;
  private closed: string | null = null;

  private constructor(private readonly ws: WebSocket) {}

  /**
   * Open a session: connect, send the hello ({token, proof}), wait for {"attached": true}.
   * Rejects with the trunk's reason when it closes the socket instead (a bad token, ...).
   */
  static open(url: string, token: string, proof: string | null = null,
              timeoutMs = 10000): Promise<TrunkSocket> {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(url);
      ws.binaryType = "arraybuffer";
      const socket = new TrunkSocket(ws);
      const timer = setTimeout(() => {
        ws.close();
        reject(new Error(`splitlearn trunk: no answer from ${url} within ${timeoutMs} ms`));
      }, timeoutMs);
      ws.onopen = () => ws.send(JSON.stringify(proof ? { token, proof } : { token }));
      ws.onmessage = (event) => {
        clearTimeout(timer);
        if (typeof event.data === "string" && JSON.parse(event.data).attached === true) {
          socket.listen();
          resolve(socket);
        } else {
          ws.close();
          reject(new Error("splitlearn trunk: an unexpected answer to the hello"));
        }
      };
      ws.onclose = (event) => {
        clearTimeout(timer);
        reject(new Error(event.reason || `splitlearn trunk: closed (code ${event.code})`));
      };
    });
  }

  private listen(): void {
    this.ws.onmessage = (event) => {
      const waiter = this.waiter;
      this.waiter = null;
      if (!waiter) return; // a reply nobody waits for: the trunk answers one per request
      if (typeof event.data === "string") {
        waiter.reject(new Error("splitlearn trunk: text where a reply frame belongs"));
        return;
      }
      const bytes = new Uint8Array(event.data as ArrayBuffer);
      this.bytesDown += bytes.length;
      waiter.resolve(bytes);
    };
    this.ws.onclose = (event) => {
      this.closed = event.reason || `closed (code ${event.code})`;
      this.waiter?.reject(new Error(`splitlearn trunk: ${this.closed}`));
      this.waiter = null;
    };
  }

  /** Send one request frame; resolve with its reply frame, decoded. */
  call(frame: Uint8Array, timeoutMs = 600000): Promise<Reply> {
    if (this.closed !== null) {
      return Promise.reject(new Error(`splitlearn trunk: ${this.closed}`));
    }
    if (this.waiter !== null) {
      return Promise.reject(new Error("splitlearn trunk: one request at a time"));
    }
    const sent = performance.now();
    return new Promise<Uint8Array>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiter = null;
        this.ws.close();
        reject(new Error(`splitlearn trunk: no reply within ${timeoutMs} ms`));
      }, timeoutMs);
      this.waiter = {
        resolve: (reply) => {
          clearTimeout(timer);
          this.waitS += (performance.now() - sent) / 1000;
          resolve(reply);
        },
        reject: (err) => { clearTimeout(timer); reject(err); },
      };
      this.bytesUp += frame.length;
      this.ws.send(frame);
    }).then(readReply);
  }

  nextSeq(): number {
    this.seq += 1;
    return this.seq;
  }

  /** The split step's exchange: activations and labels up, the gradient at the cut down. */
  async forward(activations: Values, labels: ArrayLike<number>
                ): Promise<{ grad: Values; loss: number; correct: number }> {
    const reply = await this.call(forwardRequest(this.nextSeq(), tensorOf(activations),
                                                 int64Tensor(labels)));
    if (reply.kind === "refusal") throw new TrunkRefused(reply.reason ?? "", reply.detail ?? "");
    if (reply.kind !== "gradient" || !reply.tensor) {
      throw new Error(`splitlearn trunk: a '${reply.kind}' reply to a forward`);
    }
    return { grad: valuesOfTensor(reply.tensor), loss: reply.loss ?? 0, correct: reply.correct ?? 0 };
  }

  /** U-shaped: the activations up (no labels), the trunk's features at the tail cut down. */
  async forwardFeatures(activations: Values): Promise<Values> {
    const reply = await this.call(forwardRequest(this.nextSeq(), tensorOf(activations), null));
    return valuesOfTensor(expect(reply, "features"));
  }

  /** U-shaped: d loss / d features up, the gradient at the cut down. */
  async backward(grad: Values): Promise<Values> {
    const reply = await this.call(backwardRequest(this.nextSeq(), tensorOf(grad)));
    return valuesOfTensor(expect(reply, "gradient"));
  }

  close(): void {
    this.ws.close(1000, "done");
  }
}
