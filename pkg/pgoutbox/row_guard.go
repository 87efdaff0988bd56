package pgoutbox

import "slices"

// rowGuard is the part of a subscription that keeps one row, or two rows
// of one ordering key, from running in two of its handlers at once when
// the row was claimed again while an earlier delivery of it is still ours.
// A claim cannot take a row we lease or hold, unless that protection ended
// under us: a held batch's connection died (its transaction rolled back,
// the row is due at once, and we learn it only when the batch ends), or a
// lease expired. The claimed row then waits, parked, until the earlier
// delivery is let go: ended without a hand-out, or its handler answered
// after its row was lost. Only the owner touches it.
type rowGuard struct {
	byID   map[int64]*delivery     // the delivery of each row that is ours, or whose handler still runs
	byKey  map[string]*delivery    // the same for keyed rows, by ordering key
	parked map[*delivery]*delivery // a row claimed again → the earlier delivery it waits for
	// lost are the deliveries handed to a slot whose row was lost while
	// their handler ran: their context is cancelled, and the slot waits
	// for the handler's answer before a parked row of theirs goes out.
	lost map[*delivery]struct{}
}

func newRowGuard() rowGuard {
	return rowGuard{byID: map[int64]*delivery{}, byKey: map[string]*delivery{},
		parked: map[*delivery]*delivery{}, lost: map[*delivery]struct{}{}}
}

// claimed registers a claimed row, or parks it and returns the earlier
// delivery it waits for.
func (g *rowGuard) claimed(d *delivery) (earlier *delivery) {
	if e := g.earlier(d); e != nil {
		g.parked[d] = e
		return e
	}
	g.byID[d.id] = d
	if d.orderingKey != "" {
		g.byKey[d.orderingKey] = d
	}
	return nil
}

// earlier is the delivery still ours that d must not run beside: one of
// the same row, or of the same ordering key.
func (g *rowGuard) earlier(d *delivery) *delivery {
	if e, ok := g.byID[d.id]; ok && e != d {
		return e
	}
	if d.orderingKey != "" {
		if e, ok := g.byKey[d.orderingKey]; ok && e != d {
			return e
		}
	}
	return nil
}

// letGo forgets d, whose handler (if it had one) has answered, and returns
// the parked rows that may go out now, oldest first. A row that waited for
// d and now finds another earlier delivery waits for that one.
func (g *rowGuard) letGo(d *delivery) []*delivery {
	if g.byID[d.id] == d {
		delete(g.byID, d.id)
	}
	if d.orderingKey != "" && g.byKey[d.orderingKey] == d {
		delete(g.byKey, d.orderingKey)
	}
	if len(g.parked) == 0 {
		return nil
	}
	var waiting []*delivery
	for w, e := range g.parked {
		if e == d {
			waiting = append(waiting, w)
		}
	}
	slices.SortFunc(waiting, func(a, b *delivery) int { return int(a.id - b.id) })
	free := waiting[:0]
	for _, w := range waiting {
		delete(g.parked, w)
		if w.state == finished {
			continue
		}
		if g.claimed(w) == nil {
			free = append(free, w)
		}
	}
	return free
}

// takeParked returns every parked row still ours, oldest first, and
// forgets them (the subscription stops: they go back).
func (g *rowGuard) takeParked() []*delivery {
	var out []*delivery
	for w := range g.parked {
		if w.state != finished {
			out = append(out, w)
		}
	}
	clear(g.parked)
	slices.SortFunc(out, func(a, b *delivery) int { return int(a.id - b.id) })
	return out
}
