// Makes the built docs page self-contained: Redoc's footer logo is fetched from Redocly's CDN,
// which fails offline (and phones out); it becomes an inline SVG. Fails the build if another
// asset of that CDN appears. (The bundle also names cdn.redocly.com icon sets that this page
// never loads; the browser test in tests/contract/src/console.test.ts fails on any request that
// does not succeed.)
import { readFileSync, writeFileSync } from "node:fs";

const path = new URL("../dist/index.html", import.meta.url);
const logo = (text: string) =>
  `data:image/svg+xml,${encodeURIComponent(
    `<svg xmlns="http://www.w3.org/2000/svg" width="120" height="20" viewBox="0 0 120 20"><text x="0" y="15" font-family="sans-serif" font-size="13" fill="#8a8a8a">${text}</text></svg>`,
  )}`;
let html = readFileSync(path, "utf8")
  .replaceAll("https://cdn.redoc.ly/redoc/logo-mini-full.svg", logo("Redocly"))
  .replaceAll("https://cdn.redoc.ly/redoc/logo-mini.svg", logo("Redocly"));
const remote = [...html.matchAll(/https:\/\/cdn\.redoc\.ly\/[^\s"'`)]*/g)].map((m) => m[0]);
if (remote.length > 0) {
  console.error(`docs: the page still loads from a CDN: ${[...new Set(remote)].join(", ")}`);
  process.exit(1);
}
html = html.replace("<head>", '<head>\n<link rel="icon" href="/favicon.ico">');
writeFileSync(path, html);
