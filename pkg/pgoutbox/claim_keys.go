package pgoutbox

import (
	"slices"
	"time"
)

// claimKeys is what the claims ask for by ordering key: the keys whose row
// ended (their next row may lie behind the cursor, where the scan passed it
// while its predecessor was present), the keys asked for once more after a
// full claim left them out, and the keys whose next row is a retry due
// later. Part of claimSchedule: only the owner touches it.
type claimKeys struct {
	ended      map[string]struct{}
	askedAgain map[string]struct{}  // ended keys a full claim left without a row, asked for once more (see claimed)
	due        map[string]time.Time // keys whose next row is a retry due then: asked for from then on (see dueAt)
	dueNext    time.Time            // the earliest of due: claims before it skip the map
}

func newClaimKeys() claimKeys {
	return claimKeys{ended: map[string]struct{}{}, askedAgain: map[string]struct{}{}, due: map[string]time.Time{}}
}

// keyDueGrace is how long after its due time a retried row's key is asked
// for (see dueAt); maxKeysDue bounds the keys remembered so (an outage
// that fails every key's message, with long retry delays: each claim
// looks through them while one is due).
const (
	keyDueGrace = time.Second
	maxKeysDue  = 1024
)

// any reports whether keys ended that no claim asked for yet.
func (k *claimKeys) any() bool { return len(k.ended) > 0 }

// end records that a row of key was written or left our hands: the next
// claim asks for the key's next row.
func (k *claimKeys) end(key string) {
	k.ended[key] = struct{}{}
	delete(k.askedAgain, key) // a row of it ended again: its next is new
}

// dueAt records that a row of key was returned to be retried at about at
// (this process's clock). Asking for the key when the row ended found it
// not yet due, and its new due time put it behind the rest of a backlog:
// the claims' scan would reach it only at its pass's end, seconds later,
// its key waiting all along. So claims ask for the key again from at on,
// until one returns a row of it or keyDueGrace passed (the server's clock,
// which set the row's due time, may run behind ours).
func (k *claimKeys) dueAt(key string, at time.Time) {
	if _, ok := k.due[key]; !ok && len(k.due) >= maxKeysDue {
		return // the scan's pass reaches it, later
	}
	k.due[key] = at
	if len(k.due) == 1 || at.Before(k.dueNext) {
		k.dueNext = at
	}
}

// take returns the keys the next claim asks for: the ended ones and those
// whose retry is due at now.
func (k *claimKeys) take(now time.Time) []string {
	if len(k.due) > 0 && !now.Before(k.dueNext) {
		k.dueNext = time.Time{}
		for key, at := range k.due {
			switch {
			case now.Before(at):
				if k.dueNext.IsZero() || at.Before(k.dueNext) {
					k.dueNext = at
				}
				continue
			case now.Sub(at) > keyDueGrace:
				delete(k.due, key)
			default:
				k.dueNext = now // due: asked again by the next claim too
			}
			k.ended[key] = struct{}{}
		}
	}
	if len(k.ended) == 0 {
		return nil
	}
	keys := make([]string, 0, len(k.ended))
	for key := range k.ended {
		keys = append(keys, key)
	}
	clear(k.ended)
	return keys
}

// notAsked takes back keys a claim that failed was to ask for.
func (k *claimKeys) notAsked(keys []string) {
	for _, key := range keys {
		k.ended[key] = struct{}{}
	}
}

// askAgain makes the next claim ask again for the keys r asked for and
// took nothing of.
func (k *claimKeys) askAgain(r claimResult) {
	for _, key := range r.req.endedKeys {
		if !slices.ContainsFunc(r.rows, func(d *delivery) bool { return d.orderingKey == key }) {
			k.ended[key] = struct{}{}
		}
	}
}

// claimed takes in the rows of a claim that ran.
func (k *claimKeys) claimed(r claimResult) {
	if len(k.due) > 0 {
		for _, d := range r.rows {
			delete(k.due, d.orderingKey)
		}
	}
	if len(r.req.endedKeys) == 0 {
		return
	}
	// A full claim may have left out the next rows of some ended keys:
	// they did not fit. Those keys are asked for once more, not until
	// a claim comes back short: in a backlog every claim is full, and
	// a key with no next row at all (a key per order, used once) was
	// asked for again by every claim, each asking for every key ended
	// so far (20,000 such keys drained at 190 messages a second). A
	// row that misses its second ask too is reached by the scan's
	// pass from the start, within a second.
	full := len(r.rows) >= r.req.n || r.reclaimed > 0
	got := map[string]bool{}
	for _, d := range r.rows {
		got[d.orderingKey] = true
	}
	for _, key := range r.req.endedKeys {
		_, again := k.askedAgain[key]
		switch {
		case got[key] || !full || again:
			delete(k.askedAgain, key)
		default:
			k.askedAgain[key] = struct{}{}
			k.ended[key] = struct{}{}
		}
	}
}
