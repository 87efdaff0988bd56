package pgoutbox

import (
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// An ack commits asynchronously (synchronous_commit off), and a server
// that crashes loses the commits of its last few hundred milliseconds
// (three wal_writer_delays): such a row stays leased to a live consumer
// that believes it acked, until its lease ends, and with an ordering key
// it holds its whole key back all that while (a keyed topic stopped for
// a Lease after a crash). So when the liveness lock lapses (its LISTEN
// connection went with a crashed server, or a check was slow), the acks
// written within recentAckWindow before, and those reported until then,
// are written again once the lock is held again: under their tokens, so
// one that had committed finds nothing. The window covers the lock's
// confirmation lapse and the lost commits.
const (
	recentAckWindow = 5 * time.Second
	maxRecentAcks   = 16384
)

// ackedRow is an ack written: its row and the lease it deleted it under.
type ackedRow struct {
	id    int64
	token [16]byte
	at    instant // when the write reported it
}

// recentAcks keeps the acks written within recentAckWindow, oldest first,
// at most maxRecentAcks of them: what a busy subscription acked five
// seconds ago, an idle one lets go of (trim).
type recentAcks struct {
	rows []ackedRow
	head int // rows before it are gone
}

func (r *recentAcks) add(a ackedRow) {
	r.trim(a.at)
	if len(r.rows)-r.head >= maxRecentAcks {
		r.head++
	}
	if r.head > 0 && r.head >= len(r.rows)/2 {
		r.rows = r.rows[:copy(r.rows, r.rows[r.head:])]
		r.head = 0
	}
	r.rows = append(r.rows, a)
}

// trim lets go of the acks older than recentAckWindow at now.
func (r *recentAcks) trim(now instant) {
	for r.head < len(r.rows) && now.since(r.rows[r.head].at) > recentAckWindow {
		r.head++
	}
	if r.head == len(r.rows) {
		r.rows, r.head = nil, 0
	}
}

// latest returns the acks kept, oldest first.
func (r *recentAcks) latest() []ackedRow { return slices.Clone(r.rows[r.head:]) }

// lastOfEachRow returns the last ack of each row of acks: a row acked,
// delivered again and acked again was deleted under the later token (and
// the Ack statement takes each row once).
func lastOfEachRow(acks []ackedRow) []ackedRow {
	last := make(map[int64]int, len(acks))
	rows := make([]ackedRow, 0, len(acks))
	for _, a := range acks {
		if i, ok := last[a.id]; ok {
			rows[i] = a
			continue
		}
		last[a.id] = len(rows)
		rows = append(rows, a)
	}
	return rows
}

// reackRecent runs at every change of the liveness lock. When the lock
// lapsed, it queues the acks written lately to be written again (see
// recentAckWindow); until they are written, acks reported meanwhile join
// them (reacking: the report of a write the crash interrupted comes
// after the lapse). When the lock is back with nothing queued, that ends.
func (sub *subscription) reackRecent(now time.Time) {
	w := &sub.writes
	switch {
	case sub.cfg.SynchronousCommit:
	case w.reacking():
		if len(w.reacks) == 0 && sub.holder().Valid {
			w.reacksUntil = time.Time{}
		}
	case !sub.holder().Valid: // lapsed, not just taken
		w.acked.trim(at(now))
		w.reacks, w.reacksUntil = w.acked.latest(), now.Add(sub.cfg.Lease)
	}
}

// reacking reports whether acks wait to be written again (reackRecent).
func (w *writeQueue) reacking() bool { return !w.reacksUntil.IsZero() }

// ackWritten records an ack the completer wrote: kept for a lapse to
// come, and written again with those of a lapse under way.
func (w *writeQueue) ackWritten(a ackedRow) {
	w.acked.add(a)
	if w.reacking() {
		w.reacks = append(w.reacks, a)
	}
}

// onReacked applies the result of writing lost acks again (reackRecent):
// done, or kept for the next write, after a backoff, until the rows'
// leases have ended anyway.
func (sub *subscription) onReacked(r writeResult) {
	w := &sub.writes
	if len(r.job.reacks) == 0 || len(w.reacks) == 0 {
		return
	}
	switch {
	case r.reackErr == nil:
		w.reacks, w.reacksUntil = nil, time.Time{}
		if r.reacked > 0 {
			sub.logger.Info("Acks lost by the database written again: its server had lost their commits (a crash loses the last asynchronous ones), and their rows were still leased to this subscriber", watermill.LogFields{"rows": r.reacked})
		}
	case time.Now().After(w.reacksUntil):
		w.reacks, w.reacksUntil = nil, time.Time{}
	}
}
