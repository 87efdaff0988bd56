package pgoutbox

import "time"

// drain is the part of a subscription that stops it: claiming and handing
// out end, handlers get until the drain's end to answer, and the rows
// still out are released after it. Only the owner touches it.
type drain struct {
	stopping bool
	over     bool      // the drain ended: no verdict is waited for
	end      time.Time // when the drain ends; zero once it did
}
