package pgoutbox

import (
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// writeJob is one batch of writes.
type writeJob struct {
	acks          []*delivery
	returns       []returnOp
	holds         []holdOp
	dead          []deadOp
	renew         []*delivery
	renewHolder   pgtype.Int8 // the liveness key the renewed rows are stamped with
	releaseTokens []pgtype.UUID
	reacks        []ackedRow // acks to write again (see reackRecent)
	// wakeGroup: a keyed row ended while the subscription stops, so it
	// will not claim the key's next row; the group's other subscribers
	// are woken after the job's writes (the NOTIFY a release sends), or
	// they would find the key free only at their next idle poll.
	wakeGroup bool
}

// returnOp gives a row back: a nack (due again after delay) or a release
// (due again at once, keeping its place).
type returnOp struct {
	d        *delivery
	delay    pgtype.Int8 // invalid: keep available_at
	undo     int32       // 1: the row was never handed to a handler, take its delivery back
	err      pgtype.Text // invalid: keep last_error
	meta     pgtype.Text // invalid: keep metadata
	giveBack bool        // a give-back the owner's claims wait for
}

// holdOp records a nack that an ordered subscription retries itself: the
// row stays leased under a renewed lease. The retry's delivery is counted
// when it goes out (a second hold, countOnly), not at a nack whose retry
// waits: a crash during the wait would leave counted a delivery that never
// ran. A retry due at once is counted by the nack's hold.
type holdOp struct {
	d         *delivery
	err       pgtype.Text
	meta      pgtype.Text
	counts    bool // the retry's delivery is counted
	countOnly bool // the count alone, at the retry's hand-out (no nack to report)
}

type deadOp struct {
	d      *delivery
	reason string
	err    pgtype.Text
}

func (j *writeJob) ops() int { return len(j.acks) + len(j.returns) + len(j.holds) + len(j.dead) }

func (j *writeJob) empty() bool { return j.ops() == 0 && j.renew == nil && !j.wakeGroup }

// merge returns j followed by later's operations.
func (j writeJob) merge(later writeJob) writeJob {
	j.acks = append(j.acks, later.acks...)
	j.returns = append(j.returns, later.returns...)
	j.holds = append(j.holds, later.holds...)
	j.dead = append(j.dead, later.dead...)
	if j.renew == nil {
		j.renew, j.renewHolder = later.renew, later.renewHolder
	}
	j.wakeGroup = j.wakeGroup || later.wakeGroup
	return j
}

// has reports whether d has an operation in j (acks, returns, holds, dead).
func (j *writeJob) has(d *delivery) bool {
	if j.ops() == 0 {
		return false
	}
	for _, x := range j.acks {
		if x == d {
			return true
		}
	}
	for _, op := range j.returns {
		if op.d == d {
			return true
		}
	}
	for _, op := range j.holds {
		if op.d == d {
			return true
		}
	}
	for _, op := range j.dead {
		if op.d == d {
			return true
		}
	}
	return false
}

// writeResult is what a job wrote.
type writeResult struct {
	job       writeJob
	sent      time.Time // when the job's first statement was sent: leases it set end Lease after, at the latest
	renewSent time.Time // the same for the renewal
	done      written
	abandoned map[*delivery]error // rows whose own write fails for good
	// present: of the acks that missed their row, those whose row is
	// still in the outbox (leased by another consumer, or due again); nil
	// when none missed or the look failed.
	present    map[int64]bool
	renewed    bool // the renewal ran (its rows are in renewDone, or lost)
	renewDone  written
	releaseErr error    // the release of lost claims failed
	reacked    int      // rows the reacks deleted: their acks had been lost
	reackErr   error    // the reacks failed, or were not run
	left       writeJob // not written after a transient error
	err        error
}
