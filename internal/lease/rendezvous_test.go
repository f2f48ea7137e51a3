package lease

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func names(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return out
}

func assign(members, items []string) map[string]string {
	out := make(map[string]string, len(items))
	for _, it := range items {
		out[it] = TargetOwner(members, it)
	}
	return out
}

func TestTargetOwnerIsDeterministicAndOrderFree(t *testing.T) {
	members := names("worker-", 7)
	items := names("orders/", 500)
	want := assign(members, items)
	shuffled := slices.Clone(members)
	r := rand.New(rand.NewPCG(1, 2))
	for range 5 {
		r.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		for it, owner := range assign(shuffled, items) {
			if want[it] != owner {
				t.Fatalf("item %s: owner %s with members %v, %s with %v", it, want[it], members, owner, shuffled)
			}
		}
	}
	if TargetOwner(nil, "x") != "" {
		t.Error("TargetOwner with no members must be empty")
	}
	if TargetOwner([]string{"only"}, "x") != "only" {
		t.Error("TargetOwner with one member must be that member")
	}
}

func TestTargetOwnerBalances(t *testing.T) {
	members := names("worker-", 10)
	items := names("orders/", 20000)
	count := map[string]int{}
	for _, owner := range assign(members, items) {
		count[owner]++
	}
	for _, m := range members {
		// Expected 2000 each; 10% is over 4 standard deviations.
		if c := count[m]; c < 1800 || c > 2200 {
			t.Errorf("member %s owns %d of 20000 items; want about 2000", m, c)
		}
	}
}

func TestTargetOwnerMovesAboutOneNthOnChange(t *testing.T) {
	members := names("worker-", 10)
	items := names("orders/", 20000)
	before := assign(members, items)

	// Adding an 11th member moves about 1/11 of the items, all to it.
	grown := append(slices.Clone(members), "worker-new")
	moved := 0
	for it, owner := range assign(grown, items) {
		if owner != before[it] {
			moved++
			if owner != "worker-new" {
				t.Fatalf("item %s moved from %s to %s, not to the new member", it, before[it], owner)
			}
		}
	}
	if frac := float64(moved) / float64(len(items)); frac < 0.08 || frac > 0.10 {
		t.Errorf("adding 1 of 11 members moved %.3f of items; want about %.3f", frac, 1.0/11)
	}

	// Removing one of 10 moves exactly its items, about 1/10.
	shrunk := slices.DeleteFunc(slices.Clone(members), func(m string) bool { return m == "worker-3" })
	moved = 0
	for it, owner := range assign(shrunk, items) {
		if owner != before[it] {
			moved++
			if before[it] != "worker-3" {
				t.Fatalf("item %s moved from %s, which stayed", it, before[it])
			}
		}
	}
	if frac := float64(moved) / float64(len(items)); frac < 0.09 || frac > 0.11 {
		t.Errorf("removing 1 of 10 members moved %.3f of items; want about 0.100", frac)
	}
}

func TestAssignIsDeterministicAndOrderFree(t *testing.T) {
	members := names("worker-", 7)
	items := names("orders/", 500)
	want := Assign(members, items)
	if len(want) != len(items) {
		t.Fatalf("assigned %d of %d items", len(want), len(items))
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 5 {
		m, it := slices.Clone(members), slices.Clone(items)
		r.Shuffle(len(m), func(i, j int) { m[i], m[j] = m[j], m[i] })
		r.Shuffle(len(it), func(i, j int) { it[i], it[j] = it[j], it[i] })
		m = append(m, m[0]) // duplicates are ignored
		for item, owner := range Assign(m, it) {
			if want[item] != owner {
				t.Fatalf("item %s: owner %s, then %s after shuffling", item, want[item], owner)
			}
		}
	}
	if got := Assign(nil, items); len(got) != 0 {
		t.Errorf("Assign with no members = %d entries; want none", len(got))
	}
}

// Plain rendezvous hashing leaves 12 items over 3 members outside 2..6 each
// for about a quarter of member names; Assign never exceeds the ceiling.
func TestAssignBoundsTheLoad(t *testing.T) {
	items := names("orders/", 12)
	plainUnbalanced := 0
	for k := range 500 {
		members := []string{fmt.Sprintf("w%d-a", k), fmt.Sprintf("w%d-b", k), fmt.Sprintf("w%d-c", k)}
		count := map[string]int{}
		for _, owner := range Assign(members, items) {
			count[owner]++
		}
		for _, m := range members {
			if count[m] != 4 {
				t.Fatalf("members %v: loads %v; want 4 each", members, count)
			}
		}
		plain := map[string]int{}
		for _, owner := range assign(members, items) {
			plain[owner]++
		}
		for _, m := range members {
			if plain[m] < 2 || plain[m] > 6 {
				plainUnbalanced++
				break
			}
		}
	}
	t.Logf("plain rendezvous hashing was outside 2..6 for %d of 500 member sets", plainUnbalanced)

	count := map[string]int{}
	for _, owner := range Assign(names("worker-", 7), names("orders/", 100)) {
		count[owner]++
	}
	for m, c := range count {
		if c > 15 { // ceil(100/7)
			t.Errorf("member %s owns %d of 100 items; want at most 15", m, c)
		}
	}
}

// Bounded load moves a little more than the minimum 1/N when the member set
// changes, and far less than a rehash would.
func TestAssignMovesAboutOneNthOnChange(t *testing.T) {
	members := names("worker-", 10)
	items := names("orders/", 2000)
	before := Assign(members, items)
	moved := func(after map[string]string) float64 {
		n := 0
		for it, owner := range after {
			if before[it] != owner {
				n++
			}
		}
		return float64(n) / float64(len(items))
	}
	if f := moved(Assign(append(slices.Clone(members), "worker-new"), items)); f < 1.0/11 || f > 1.3/11 {
		t.Errorf("adding 1 of 11 members moved %.3f of items; want between %.3f and %.3f", f, 1.0/11, 1.3/11)
	}
	if f := moved(Assign(members[1:], items)); f < 0.1 || f > 0.13 {
		t.Errorf("removing 1 of 10 members moved %.3f of items; want between 0.100 and 0.130", f)
	}
}
