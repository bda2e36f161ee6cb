//! Everything that reads bytes from the network or a file never panics: the QNP header, the TLV
//! reader and its value getters, and the image reader and Matcher model on arbitrary images.
#![no_main]
use flatmesh_qnp::header::QnpHeader;
use flatmesh_qnp::image::Image;
use flatmesh_qnp::tlv::{self, TlvReader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((hdr, payload)) = QnpHeader::parse(data) {
        assert_eq!(&hdr.to_bytes()[..18], &data[..18]);
        for t in TlvReader::new(payload) {
            let Ok(t) = t else { break };
            let _ = tlv::get_i32(&t);
            let _ = tlv::get_i64(&t);
            let _ = tlv::get_string(&t);
        }
        let _ = tlv::find_field(payload, hdr.app_id);
    }
    if let Ok(img) = Image::from_bytes(data) {
        let _ = img.explain();
        let _ = img.run(data.get(10).copied().unwrap_or(0), 0, |_| Some(data));
    }
});
