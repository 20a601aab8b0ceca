import { uuidv7 } from "@arbor/store";
import type { NextFunction, Request, Response } from "express";

const acceptable = /^[\w.:-]{1,128}$/;

/** Every response carries `x-request-id`, echoing the request's own when it is sane. */
export function requestId(req: Request, res: Response, next: NextFunction): void {
  const sent = req.header("x-request-id");
  const id = sent && acceptable.test(sent) ? sent : uuidv7();
  res.locals.requestId = id;
  res.setHeader("x-request-id", id);
  next();
}
