package devstack

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// FreePort returns a TCP port on 127.0.0.1 that is free now and lies below
// the kernel's ephemeral range. Another process may still bind it before the
// caller does; callers that can, retry.
//
// Why not port 0: the kernel hands port-0 listeners a port from the
// ephemeral range, the same range it draws the source ports of outgoing
// connections from. Between FreePort and the server binding the port, a
// client dialling elsewhere can get it as its source port, and a client
// dialling the port itself while nothing listens can be connected to itself
// (TCP simultaneous open). Both happened to a 3-node NATS cluster whose
// nodes dial each other's route ports at start: one node failed with
// "address already in use". Ports below the ephemeral range are never a
// source port. The range starts at 20000, above the fixed ports kfn's
// scripts default to (Kafka 19092–19193).
func FreePort() (int, error) {
	low := ephemeralLow()
	const floor = 20000
	if low-floor >= 1000 {
		for range 50 {
			port := floor + rand.IntN(low-floor)
			if free(port) {
				return port, nil
			}
		}
	}
	// A kernel whose ephemeral range starts low: take what it gives.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port on 127.0.0.1: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// free reports whether port can be bound on 127.0.0.1 now.
func free(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// ephemeralLow is the first port of the kernel's ephemeral range: Linux's
// ip_local_port_range, or IANA's 49152 where that cannot be read.
func ephemeralLow() int {
	low, err := readEphemeralLow("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 49152
	}
	return low
}

func readEphemeralLow(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	fields := strings.Fields(string(b))
	if len(fields) != 2 {
		return 0, errors.New("ip_local_port_range: want two numbers, got " + strconv.Quote(string(b)))
	}
	return strconv.Atoi(fields[0])
}
