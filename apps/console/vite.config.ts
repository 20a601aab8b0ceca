import { defineConfig } from "vite";

// Served by the server at /console; everything it loads is in dist/ (no CDN, works offline).
export default defineConfig({
  base: "/console/",
  build: { outDir: "dist", emptyOutDir: true, sourcemap: true, chunkSizeWarningLimit: 1024 },
});
