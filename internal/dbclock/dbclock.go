// Package dbclock reads the database's clock, for comparisons with times
// the database wrote (a dead letter's failed_at): the client's clock may
// be off by any amount.
package dbclock

import (
	"context"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Now returns the database's current time (clock_timestamp, not the
// transaction's start).
func Now(ctx context.Context, exec tx.Executor) (time.Time, error) {
	rows, err := exec.Query(ctx, "SELECT clock_timestamp()")
	if err != nil {
		return time.Time{}, err
	}
	defer rows.Close()
	var t time.Time
	if rows.Next() {
		err = rows.Scan(&t)
	}
	if err == nil {
		err = rows.Err()
	}
	return t, err
}

// Before narrows an upper bound on a time (zero: none) to t: the earlier
// of the two. A listing of what failed before a statement began keeps a
// filter's own bound when that is earlier.
func Before(bound, t time.Time) time.Time {
	if bound.IsZero() || t.Before(bound) {
		return t
	}
	return bound
}
