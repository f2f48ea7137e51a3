// Live refresh: an element with data-refresh is fetched again every
// data-every milliseconds and its content replaced by the server's
// rendering (html/template escaped). No page reload, no inline script.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  for (const el of document.querySelectorAll("[data-refresh]")) {
    const every = Math.max(1000, parseInt(el.dataset.every, 10) || 2000);
    const refresh = async () => {
      try {
        const res = await fetch(el.dataset.refresh, { credentials: "same-origin", cache: "no-store" });
        if (res.ok) {
          el.innerHTML = await res.text();
          el.dataset.refreshed = String(Date.now());
        }
      } catch (e) {
        // a missed refresh is retried at the next tick
      }
      setTimeout(refresh, every);
    };
    setTimeout(refresh, every);
  }
});
