package operator

import (
	"context"

	"github.com/kfn-dev/kfn/inbox"
)

// AuditFilter selects rows of kfn.audit_log; see inbox.AuditFilter.
type AuditFilter = inbox.AuditFilter

// AuditLog returns the audit rows f selects, oldest first (with a limit,
// the newest f.Limit). The partition claims that workers write on every
// lease claim (action "claim") are left out unless f.Action asks for them.
func AuditLog(ctx context.Context, db inbox.Querier, f AuditFilter) ([]inbox.AuditEntry, error) {
	if f.Action == "" {
		f.NotAction = inbox.ActionClaim
	}
	return inbox.ReadAudit(ctx, db, f)
}
