import { Ajv2020 } from "ajv/dist/2020.js";
import { describe, expect, it } from "vitest";
import { ApiError, envelope, toApiError } from "./errors.ts";
import { loadSpec } from "./openapi.ts";

const spec = loadSpec();
const ajv = new Ajv2020({ strict: false });
ajv.addSchema({ ...spec, $id: "spec" });
const schema = (name: string) => ajv.getSchema(`spec#/components/schemas/${name}`)!;

describe("error envelopes", () => {
  it.each([400, 401, 403, 404, 409, 413, 429, 500, 501, 503])(
    "when a /v1 error has status %i, then the body is a valid ErrorResponse",
    (status) => {
      const { body } = envelope("v1", new ApiError(status, "boom", { code: "c" }), "rid");
      const valid = schema("ErrorResponse");
      expect(valid(body), JSON.stringify(valid.errors)).toBe(true);
    },
  );

  it.each([401, 403, 404, 409, 413, 500])(
    "when a /calls error has status %i, then the body is a valid CallsError",
    (status) => {
      const { body } = envelope("calls", new ApiError(status, "boom"), "rid");
      const valid = schema("CallsError");
      expect(valid(body), JSON.stringify(valid.errors)).toBe(true);
    },
  );

  it("when a /calls request fails validation, then it is a 422 HTTPValidationError", () => {
    const { error } = toApiError({
      status: 400,
      message: "request/body/limit must be >= 1",
      errors: [
        { path: "/body/limit", message: "must be >= 1", errorCode: "minimum.openapi.validation" },
      ],
    });
    const { status, body } = envelope("calls", error, "rid");
    expect(status).toBe(422);
    expect(body).toEqual({
      detail: [
        {
          loc: ["body", "limit"],
          msg: "Input should be greater than or equal to 1",
          type: "greater_than_equal",
        },
      ],
    });
    expect(schema("HTTPValidationError")(body)).toBe(true);
  });

  it("when a /v1 request fails validation, then param is the JSON path of the field", () => {
    const { error } = toApiError({
      status: 400,
      message: "bad",
      errors: [
        {
          path: "/body/messages/0/role",
          message: "must be equal to one of the allowed values",
          errorCode: "enum.openapi.validation",
        },
      ],
    });
    const { status, body } = envelope("v1", error, "rid");
    expect(status).toBe(400);
    expect(body).toEqual({
      error: {
        message: "messages[0].role: must be equal to one of the allowed values",
        type: "invalid_request_error",
        param: "messages[0].role",
        code: null,
      },
    });
  });

  it("when something unknown is thrown, then the body hides it behind the request id", () => {
    const { error, unexpected } = toApiError(new Error("secret stack detail"));
    expect(unexpected).toBe(true);
    const { status, body } = envelope("v1", error, "rid-1");
    expect(status).toBe(500);
    expect(JSON.stringify(body)).not.toContain("secret");
    expect(JSON.stringify(body)).toContain("rid-1");
  });
});
