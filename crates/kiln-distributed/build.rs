//! Compiles the coordination service's .proto at build time with a Rust protobuf compiler, so
//! that no `protoc` needs installing.
fn main() {
    let proto = "proto/coordination_service.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"]).expect("proto/coordination_service.proto compiles");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)
        .expect("the coordination service's Rust code generates");
}
