// Package console owns kfn console: a web console for the people on call,
// served from the kfn binary. It shows every lane's owner, cursor and lag,
// groups the dead letters by function, reason and error fingerprint, shows a
// record's bytes inertly, and retries, discards and replays through the
// same operator functions the CLI calls, so each action is audited with the
// console user as its actor.
//
// It reads and acts on each function's own database (--function-databases)
// and merges the databases on the pages about every function.
//
// It owns the console's security model: every request is authenticated
// (an auth file of users and roles, or an explicitly trusted proxy
// header), failed logins lock a user name or a client address out for a
// growing time, the console is read-only unless started with writes allowed and
// a write also needs the writer role, every POST carries a CSRF token, and
// every page is sent with a strict Content-Security-Policy that allows no
// inline script or style. Templates are html/template, so record bytes are
// escaped wherever they appear. The assets are embedded; the package needs
// nothing but the standard library beyond kfn's own packages.
//
// It is not a stable API: cmd/kfn is its only user.
package console
