package pgoutbox

import (
	"slices"
	"time"
)

// aloneRow is, with MaxDeliveries set, the row delivered before that runs
// with nothing beside it (runsAlone). Part of handout: only the owner
// touches it.
type aloneRow struct {
	row *delivery // the last one handed out
	// behind: a row that runs alone went back because rows were ahead of
	// it; claims wait until those are answered and written.
	behind bool
}

// runsAlone reports whether d goes out with nothing beside it. With
// MaxDeliveries set, a row delivered before may be one whose handler
// crashes its process; every row handed out beside it would be counted
// with it at each crash and come back with it, and reach the limit with
// it. Alone, only the row that crashes counts its crashes; a row that ran
// beside a crash once runs alone the next time.
func (sub *subscription) runsAlone(d *delivery) bool {
	return sub.cfg.MaxDeliveries > 0 && sub.outlet.slots != nil && d.deliveries > 1
}

// claimsFreshOnly reports whether the next claim leases only rows never
// delivered: a row that runs alone, leased while messages are out, has
// its delivery counted, and a crash of one of them before it went back
// (it cannot run beside them) counted it again. Such a claim passes over
// a row delivered before, locking it only, and says so (claimResult.
// passed): claims then wait until what is out is answered and written
// (awaitingAlone), and the next scans from the start, so that it brings
// the row with nothing ahead of it, unless rows due before it came.
func (sub *subscription) claimsFreshOnly() bool {
	return sub.cfg.MaxDeliveries > 0 && sub.outlet.slots != nil && (sub.hand.handed > 0 || len(sub.hand.buffer) > 0)
}

// settledForAlone reports whether a row that runs alone may go out: no
// other is handed out, no claim is running or waiting to be released,
// and every verdict and give-back is written. A crash before then would
// leave those rows leased and counted (a claim counts its rows), as if
// they had run beside it.
func (sub *subscription) settledForAlone(now time.Time) bool {
	return sub.hand.handed == 0 && !sub.claims.claiming && !sub.claims.lost.due(now) &&
		sub.claims.givingBack == 0 && !sub.writes.inWrite && sub.writes.pending.empty()
}

// awaitingAlone reports whether a row that runs alone waits: in the
// buffer, or in the outbox behind rows of ours (aloneRow.behind), until
// they are answered and written. No claim starts meanwhile, or claims
// could keep it from ever settling (settledForAlone), or bring it behind
// others again.
func (sub *subscription) awaitingAlone() bool {
	return sub.cfg.MaxDeliveries > 0 && (sub.hand.alone.behind || slices.ContainsFunc(sub.hand.buffer, sub.runsAlone))
}

// aloneSettled lets claims bring a row that runs alone, waiting in the
// outbox behind rows of ours (aloneRow.behind), once those are
// answered and written: the next claim brings it first.
func (sub *subscription) aloneSettled(now time.Time) {
	if sub.hand.alone.behind && len(sub.hand.buffer) == 0 && sub.settledForAlone(now) {
		sub.hand.alone.behind = false
	}
}

// isolating reports whether a row that runs alone is out, or answered
// and not yet written: nothing else is handed out or claimed (a claimed
// row counts a delivery) until its write is done or it ends. A row handed
// out once it was answered, while its ack waited to be written, took the
// ack with it when it crashed its process: the row that had run well came
// back, counted, and reached MaxDeliveries.
func (sub *subscription) isolating() bool {
	d := sub.hand.alone.row
	return d != nil && d.state != finished
}
