import { describe, expect, it } from "vitest";
import { withModelFiles } from "../src/checkpoints.ts";

/** A step of `withModelFiles` that ends when told to: its start and end are recorded. */
function held(log: string[], name: string) {
  let end!: () => void;
  const ended = new Promise<void>((resolve) => {
    end = resolve;
  });
  return {
    run: async () => {
      log.push(`${name} start`);
      await ended;
      log.push(`${name} end`);
    },
    end,
  };
}

const settle = () => new Promise((resolve) => setImmediate(resolve));

describe("withModelFiles", () => {
  it("when writers and a delete arrive, then writers share, the delete waits for them and runs alone, and writers after it wait for it", async () => {
    const log: string[] = [];
    const [a, b, del, c] = ["a", "b", "delete", "c"].map((n) => held(log, n)) as [
      ReturnType<typeof held>,
      ReturnType<typeof held>,
      ReturnType<typeof held>,
      ReturnType<typeof held>,
    ];
    const runs = [
      withModelFiles("m", "write", a.run),
      withModelFiles("m", "write", b.run),
      withModelFiles("m", "delete", del.run),
      withModelFiles("m", "write", c.run),
      // Another model's files are not held by any of these.
      withModelFiles("other", "delete", async () => {
        log.push("other");
      }),
    ];
    await settle();
    expect(log).toEqual(["a start", "b start", "other"]);
    a.end();
    await settle();
    expect(log.at(-1)).toBe("a end");
    b.end();
    await settle();
    expect(log.slice(-2)).toEqual(["b end", "delete start"]);
    del.end();
    await settle();
    expect(log.slice(-2)).toEqual(["delete end", "c start"]);
    c.end();
    await Promise.all(runs);
    expect(log.at(-1)).toBe("c end");
  });

  it("when the held step throws, then the files are let go all the same", async () => {
    await expect(
      withModelFiles("m", "delete", async () => {
        throw new Error("disk on fire");
      }),
    ).rejects.toThrow("disk on fire");
    await expect(withModelFiles("m", "delete", async () => "free")).resolves.toBe("free");
  });
});
