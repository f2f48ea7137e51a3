package inbox

import (
	"strconv"
	"strings"
)

// conditions builds the WHERE clause of a filtered read (the dead letters,
// the audit log): conditions joined by AND, each with one argument, which
// a condition names as $? and which is numbered in the order added.
type conditions struct {
	conds []string
	args  []any
}

// add adds cond, whose $? stands for arg.
func (w *conditions) add(cond string, arg any) {
	w.args = append(w.args, arg)
	w.conds = append(w.conds, strings.ReplaceAll(cond, "$?", "$"+strconv.Itoa(len(w.args))))
}

// clause is the WHERE clause without the keyword ("true" when nothing
// narrows the read) and its arguments.
func (w *conditions) clause() (string, []any) {
	if len(w.conds) == 0 {
		return "true", nil
	}
	return strings.Join(w.conds, " AND "), w.args
}
