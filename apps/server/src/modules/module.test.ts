import { describe, expect, it } from "vitest";
import { RESPONDED } from "../http/operations.ts";
import { type ModuleDeps, moduleHandlers, type ServerModule } from "./module.ts";

const deps = {} as ModuleDeps;
const health = (): typeof RESPONDED => RESPONDED;

describe("moduleHandlers", () => {
  it("when modules handle different operations, then it has each module's handlers", () => {
    const system = (): typeof RESPONDED => RESPONDED;
    const modules: ServerModule[] = [
      { name: "a", handlers: () => ({ getHealth: health }) },
      { name: "b" },
      { name: "c", handlers: () => ({ getSystemCheck: system }) },
    ];
    expect(moduleHandlers(modules, deps)).toEqual({ getHealth: health, getSystemCheck: system });
  });

  it("when two modules handle one operation, then it throws naming both", () => {
    const modules: ServerModule[] = [
      { name: "a", handlers: () => ({ getHealth: health }) },
      { name: "b", handlers: () => ({ getHealth: health }) },
    ];
    expect(() => moduleHandlers(modules, deps)).toThrow("a and b both handle getHealth");
  });
});
